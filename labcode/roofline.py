"""The roofline: what one forward call costs in FLOPs and bytes, and the time a machine needs for them.

Introduced in chapter 7. A call runs T new tokens after S cached ones, for B sequences.
It does the FLOPs of its matrix products (`labcode.flops`, as FlopCounterMode counts
them) and moves bytes: every weight is read once per call, whatever B and T; attention
reads the cached keys and values of every sequence; a cached call writes the new ones;
and every operation reads its input activations and writes its output. A machine that
computes `peak` FLOP/s and streams `bandwidth` bytes/s cannot do it faster than
max(FLOPs / peak, bytes / bandwidth). Each operation also has a fixed cost (Python,
dispatch), which adds up on a CPU, where nothing runs while the next operation is
prepared.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from labcode.checks import is_int
from labcode.config import GPTConfig
from labcode.cost import kv_cache_bytes
from labcode.flops import attention_flops, linear_flops, linear_params

DTYPE_BYTES = {torch.float64: 8, torch.float32: 4, torch.bfloat16: 2, torch.float16: 2, torch.int8: 1}


def element_bytes(dtype: torch.dtype | str) -> int:
    """Bytes of one element of `dtype` (a torch dtype or its name, "bfloat16")."""
    dt = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if dt not in DTYPE_BYTES:
        raise ValueError(f"dtype: expected one of {sorted(str(d).removeprefix('torch.') for d in DTYPE_BYTES)}, "
                         f"got {dtype!r}")
    return DTYPE_BYTES[dt]


def _count(name: str, value: object, low: int) -> int:
    if not is_int(value) or value < low:
        raise ValueError(f"{name}: expected an int >= {low}, got {value!r}")
    return value


def weight_shapes(cfg: GPTConfig) -> tuple[tuple[int, int, int], ...]:
    """(out, in, how many) of the weight matrices one call multiplies, by shape: per layer Q, K/V, the output
    projection and the feed-forward's, once the tied head; the shapes the memory-side ceilings are measured for."""
    c, hd, kvd, f = cfg.d_model, cfg.n_heads * cfg.head_dim, 2 * cfg.n_kv_heads * cfg.head_dim, cfg.d_ff
    n = cfg.n_layers
    ff = ((f, c, 2 * n), (c, f, n)) if cfg.mlp == "swiglu" else ((f, c, n), (c, f, n))
    counts: dict[tuple[int, int], int] = {}
    for o, i, k in ((hd, c, n), (kvd, c, n), (c, hd, n), *ff, (cfg.vocab_size, c, 1)):
        counts[(o, i)] = counts.get((o, i), 0) + k
    return tuple((o, i, k) for (o, i), k in counts.items())


def weight_elements(cfg: GPTConfig, t_new: int) -> int:
    """Parameters one call of T new tokens reads: every matrix and vector, and T rows of the position table."""
    c, d = cfg.d_model, cfg.head_dim
    vectors = cfg.n_layers * (cfg.n_heads * d + 2 * cfg.n_kv_heads * d + 10 * c) + 2 * c  # biases, LayerNorms
    positions = 0 if cfg.rotary else min(t_new, cfg.context_length) * c  # the batch shares its positions
    return linear_params(cfg) + vectors + positions


@dataclass(frozen=True)
class StepCost:
    """FLOPs and bytes of one forward call (T new tokens after S cached, batch B)."""

    flops_linear: int  # products with weights: 2 * B * T * P
    flops_attention: int  # QK^T and weights @ V: 4 * B * L * H * T * (S + T) * D
    weight_bytes: int  # every parameter once, T rows of the position table
    kv_read_bytes: int  # attention reads S + T keys and values per layer and sequence
    kv_write_bytes: int  # a cached call writes its T new keys and values (0 without a cache)
    act_linear_bytes: int  # inputs and outputs of the products with weights (the logits included)
    act_attention_bytes: int  # queries, the score matrix's passes (product, scale, mask, softmax, read), outputs
    act_other_bytes: int  # embeddings, LayerNorms, GELU, residual additions, the new K/V read for the cache write
    rows: int = 1  # rows each product with weights multiplies: B * T
    shape_bytes: tuple[tuple[int, int, int], ...] = ()  # (out, in, bytes) of the weight matrices of each shape
    queries: int = 0  # rows of queries attention runs per sequence (T): 1 for a decode step

    @property
    def flops(self) -> int:
        return self.flops_linear + self.flops_attention

    @property
    def act_bytes(self) -> int:
        return self.act_linear_bytes + self.act_attention_bytes + self.act_other_bytes

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes + self.act_bytes

    @property
    def intensity(self) -> float:
        """Arithmetic intensity: FLOPs per byte moved."""
        return self.flops / self.bytes

    def parts(self) -> dict[str, tuple[int, int]]:
        """(FLOPs, bytes) of the three kinds of operation, which run one after another."""
        return {
            "products with weights": (self.flops_linear, self.weight_bytes + self.act_linear_bytes),
            "attention": (self.flops_attention, self.kv_read_bytes + self.act_attention_bytes),
            "elementwise": (0, self.kv_write_bytes + self.act_other_bytes),
        }


def step_cost(cfg: GPTConfig, t_new: int, s_cached: int = 0, batch: int = 1, *,
              dtype: torch.dtype | str = torch.float32, kv_bytes_per_token: int | None = None,
              cached: bool = True) -> StepCost:
    """FLOPs and bytes of one forward call of T new tokens after S cached ones, for B sequences.

    `dtype` is the weights' and activations' precision; `kv_bytes_per_token` the bytes one
    token's K and V take in all layers of one sequence (default: 2 L Hkv D elements of `dtype`;
    `labcode.capacity.kv_bytes_per_token` gives it for a quantised cache, scales included).
    `cached=False` is the call without a cache: it reads the keys it has just computed and
    writes none (then S must be 0).
    """
    t, s, b = _count("t_new", t_new, 1), _count("s_cached", s_cached, 0), _count("batch", batch, 1)
    if not cached and s:
        raise ValueError(f"s_cached: expected 0 for a call without a cache, got {s}")
    e = element_bytes(dtype)
    kv_tok = (kv_cache_bytes(cfg.n_layers, 1, 1, cfg.n_kv_heads, cfg.head_dim, e) if kv_bytes_per_token is None
              else _count("kv_bytes_per_token", kv_bytes_per_token, 0))
    c, v, hd, kvd = cfg.d_model, cfg.vocab_size, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    rows, keys, n_layers = b * t, s + t, cfg.n_layers
    # Products with weights, per layer: q (C -> HD), kv (C -> 2 HkvD), out (HD -> C), fc (C -> 4C), proj (4C -> C).
    per_layer_linear = (c + hd) + (c + 2 * kvd) + (hd + c) + (c + 4 * c) + (4 * c + c)
    act_linear = rows * (n_layers * per_layer_linear + c + v)  # the head: C -> V logits
    score_passes = 6 + (2 if t > 1 else 0)  # written, scaled (read + write), softmax (read + write), read; + mask
    act_attention = n_layers * (2 * rows * hd + score_passes * b * cfg.n_heads * t * keys)
    # Per layer: two LayerNorms (read + write), GELU on 4C (read + write), two residual additions (2 reads, 1 write);
    # once: the token gather and the position addition (read + write each) and the final LayerNorm.
    act_other = rows * (n_layers * (2 * c + 2 * c + 8 * c + 6 * c) + 6 * c)
    if cached:
        act_other += n_layers * rows * 2 * kvd  # the new K and V are read to be written into the cache
    return StepCost(
        flops_linear=linear_flops(cfg, t, b),
        flops_attention=attention_flops(cfg, t, keys, b),
        weight_bytes=e * weight_elements(cfg, t),
        kv_read_bytes=b * keys * kv_tok,
        kv_write_bytes=b * t * kv_tok if cached else 0,
        act_linear_bytes=e * act_linear,
        act_attention_bytes=e * act_attention,
        act_other_bytes=e * act_other,
        rows=rows,
        shape_bytes=tuple((o, i, e * o * i * k) for o, i, k in weight_shapes(cfg)),
        queries=t,
    )


def attention_intensity(cfg: GPTConfig, t_new: int, s_cached: int = 0, batch: int = 1, *, fused: bool = False,
                        dtype: torch.dtype | str = torch.float32) -> float:
    """FLOPs per byte of a call's attention: 4 B L H T (S + T) D FLOPs over the bytes it moves.

    It reads the S + T cached keys and values of every sequence and the queries, and writes
    its outputs; eager attention also writes and reads the [T, S + T] score matrix several
    times, which a `fused` kernel (chapter 8) keeps on chip.
    """
    cost = step_cost(cfg, t_new, s_cached, batch, dtype=dtype)
    queries_and_outputs = element_bytes(dtype) * cfg.n_layers * 2 * batch * t_new * cfg.n_heads * cfg.head_dim
    moved = cost.kv_read_bytes + (queries_and_outputs if fused else cost.act_attention_bytes)
    return cost.flops_attention / moved


def prefill_cost(cfg: GPTConfig, t_new: int, s_cached: int = 0, batch: int = 1, **kw) -> StepCost:
    """A cached prefill (or chunk) of T tokens after S cached."""
    return step_cost(cfg, t_new, s_cached, batch, **kw)


def decode_cost(cfg: GPTConfig, s_cached: int, batch: int = 1, **kw) -> StepCost:
    """A cached decode step: one new token after S cached, for each of B sequences."""
    return step_cost(cfg, 1, s_cached, batch, **kw)


def uncached_cost(cfg: GPTConfig, n_tokens: int, batch: int = 1, **kw) -> StepCost:
    """A generation step without a cache: the full forward over all n tokens so far."""
    return step_cost(cfg, n_tokens, 0, batch, cached=False, **kw)


@dataclass(frozen=True)
class Machine:
    """What a machine does per second, and the fixed cost of one operation.

    `row_ceilings` holds (R, FLOP/s) pairs, R ascending: the rate measured for products
    through a weight with R rows, where that product was compute-bound. A product with
    few rows runs below the peak (the soft ridge of chapter 7); `peak_for` reads the
    ceiling for any number of rows from these. Empty: every product can reach the peak.

    The memory side has ceilings too. `stream_ceilings` holds (out, in, R, bytes/s): the
    rate at which products of R rows streamed weights of that shape where they were
    memory-bound, and `kv_bandwidth_bytes_per_s` the rate at which decode attention moved
    its bytes (its keys and values, and the queries, scores and outputs beside them);
    `stream_for` reads them. Empty or None: the `bandwidth`.

    `products_flops_per_s`, where set, is the rate products with weights reached beside one
    call, with that call's rows, through the model's shapes of weight where they were
    compute-bound: it holds that call's products instead of `peak_for` (a rate measured
    on the same products, so the peak, measured once on another, does not bound it).
    """

    peak_flops_per_s: float  # a large matrix product
    bandwidth_bytes_per_s: float  # a large matrix-vector product (streaming)
    overhead_s_per_op: float = 0.0  # fixed seconds per tensor operation (Python, dispatch)
    overlapped: bool = False  # True where operations are queued ahead (a GPU): the overhead hides behind the work
    row_ceilings: tuple[tuple[int, float], ...] = ()
    stream_ceilings: tuple[tuple[int, int, int, float], ...] = ()
    kv_bandwidth_bytes_per_s: float | None = None
    products_flops_per_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("peak_flops_per_s", "bandwidth_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Machine.{name}: expected a positive number, got {getattr(self, name)!r}")
        if not self.overhead_s_per_op >= 0:
            raise ValueError(f"Machine.overhead_s_per_op: expected >= 0, got {self.overhead_s_per_op!r}")
        ceilings = tuple((r, f) for r, f in self.row_ceilings)
        rows = [r for r, _ in ceilings]
        if not (all(is_int(r) and r >= 1 for r in rows) and rows == sorted(set(rows))
                and all(f > 0 for _, f in ceilings)):
            raise ValueError("Machine.row_ceilings: expected (rows, FLOP/s) pairs with distinct rows >= 1 in "
                             f"ascending order and positive rates, got {self.row_ceilings!r}")
        object.__setattr__(self, "row_ceilings", ceilings)
        streams = tuple((o, i, r, b) for o, i, r, b in self.stream_ceilings)
        keys = [(o, i, r) for o, i, r, _ in streams]
        if not (all(is_int(x) and x >= 1 for k in keys for x in k) and len(set(keys)) == len(keys)
                and all(b > 0 for *_, b in streams)):
            raise ValueError("Machine.stream_ceilings: expected (out, in, rows, bytes/s) with positive ints, each "
                             f"(out, in, rows) once, and positive rates, got {self.stream_ceilings!r}")
        object.__setattr__(self, "stream_ceilings", tuple(sorted(streams)))
        for name in ("kv_bandwidth_bytes_per_s", "products_flops_per_s"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ValueError(f"Machine.{name}: expected None or a positive number, got {getattr(self, name)!r}")

    @property
    def balance(self) -> float:
        """FLOPs the machine can do per byte it streams: above this intensity a call is compute-bound."""
        return self.peak_flops_per_s / self.bandwidth_bytes_per_s

    def peak_for(self, rows: int) -> float:
        """The FLOP/s a product through a weight with `rows` rows can reach: never above the peak.

        Between two measured row counts the rate is interpolated on log-log axes; below the
        fewest it is that ceiling's rate (fewer rows run slower still, but such products are
        memory-bound by their intensity); from the most on it is the peak.
        """
        _count("rows", rows, 1)
        ceil = self.row_ceilings
        if not ceil or rows >= ceil[-1][0]:
            return self.peak_flops_per_s
        return min(_log_interpolate(list(ceil), rows), self.peak_flops_per_s)

    def stream_for(self, n_out: int, n_in: int, rows: int) -> float:
        """The bytes/s at which a product of `rows` rows streams a weight [n_out, n_in]: never above the bandwidth.

        From the shape's `stream_ceilings`, interpolated between measured row counts on
        log-log axes like `peak_for`; below the fewest, that ceiling's rate. With more rows
        than any measured the product is compute-bound, and its compute ceiling holds it:
        the bandwidth. A shape without ceilings streams at the bandwidth.
        """
        _count("rows", rows, 1)
        ceil = [(r, b) for o, i, r, b in self.stream_ceilings if (o, i) == (n_out, n_in)]
        bw = self.bandwidth_bytes_per_s
        if not ceil or rows > ceil[-1][0]:
            return bw
        return min(_log_interpolate(ceil, rows), bw)


def _log_interpolate(points: list[tuple[int, float]], x: int) -> float:
    """y at x from (x, y) pairs, x ascending, interpolated on log-log axes; the first y below the first x."""
    if x <= points[0][0]:
        return points[0][1]
    exact = [y for px, y in points if px == x]
    if exact:
        return exact[0]
    (x0, y0), (x1, y1) = next((a, b) for a, b in zip(points[:-1], points[1:], strict=True) if a[0] <= x <= b[0])
    w = math.log(x / x0) / math.log(x1 / x0)
    return math.exp((1 - w) * math.log(y0) + w * math.log(y1))


@dataclass(frozen=True)
class Prediction:
    """The roofline's seconds for one call, and what they are made of."""

    t_math: float  # all FLOPs at the rates they can reach (products with weights at peak_for(rows))
    t_memory: float  # all bytes at the bandwidth
    t_parts: float  # sum over the kinds of operation of max(FLOPs / peak, bytes / bandwidth)
    t_overhead: float  # operations x fixed cost per operation
    seconds: float  # t_parts + t_overhead (or their max where the overhead is overlapped)
    bound: str  # "compute", "memory" or "overhead": the largest term

    @property
    def t_roofline(self) -> float:
        """max(t_math, t_memory): the roofline of the call taken as one operation."""
        return max(self.t_math, self.t_memory)


def predict(cost: StepCost, machine: Machine, ops: int = 0) -> Prediction:
    """Seconds `machine` needs for `cost` done by `ops` tensor operations.

    The kinds of operation run one after another, so each is held to its own limit:
    sum of max(FLOPs / peak, bytes / bandwidth) over `StepCost.parts`. That is never
    below max(t_math, t_memory), and equals it when every part has the same limit (any
    decode step at batch 1). The products with weights compute at most at
    `machine.products_flops_per_s` where the machine has it, else at
    `machine.peak_for(cost.rows)`; attention at the peak. On the memory side each shape of
    weight streams at `machine.stream_for(out, in, rows)`, and a decode step's keys and
    values (one query per sequence), with the queries, scores and outputs that attention moves
    beside them, at `machine.kv_bandwidth_bytes_per_s` where the machine has it (never above
    the bandwidth); every other byte at the bandwidth. On a CPU the
    fixed cost of the operations adds to it.
    """
    _count("ops", ops, 0)
    peak, bw = machine.peak_flops_per_s, machine.bandwidth_bytes_per_s
    peaks = {"products with weights": machine.products_flops_per_s or machine.peak_for(cost.rows)}
    parts = cost.parts()
    memory = {k: n / bw for k, (_, n) in parts.items()}
    for o, i, n in cost.shape_bytes:
        memory["products with weights"] += n / machine.stream_for(o, i, cost.rows) - n / bw
    if machine.kv_bandwidth_bytes_per_s and cost.queries == 1:  # all of attention's bytes, as the probe streams them
        memory["attention"] = parts["attention"][1] / min(machine.kv_bandwidth_bytes_per_s, bw)
    t_parts = sum(max(f / peaks.get(k, peak), memory[k]) for k, (f, _) in parts.items())
    t_overhead = ops * machine.overhead_s_per_op
    seconds = max(t_parts, t_overhead) if machine.overlapped else t_parts + t_overhead
    t_math = cost.flops_linear / peaks["products with weights"] + cost.flops_attention / peak
    t_memory = cost.bytes / bw
    bound = "overhead" if t_overhead > t_parts else ("compute" if t_math >= t_memory else "memory")
    return Prediction(t_math, t_memory, t_parts, t_overhead, seconds, bound)


def _per_sequence(cfg: GPTConfig, s_cached: int, **kw) -> tuple[int, int, int]:
    """(weight bytes, FLOPs per sequence, bytes per sequence) of a decode step: bytes(B) = w + B * k1 exactly."""
    one = decode_cost(cfg, s_cached, 1, **kw)
    return one.weight_bytes, one.flops, one.bytes - one.weight_bytes


def critical_batch(cfg: GPTConfig, s_cached: int, machine: Machine, **kw) -> float:
    """The batch from which a decode step at S cached is compute-bound as a whole: FLOPs / peak >= bytes / bandwidth.

    With w the weight bytes and f1, k1 the FLOPs and bytes each sequence adds (its K/V
    above all), B* = (w / bandwidth) / (f1 / peak - k1 / bandwidth); `math.inf` when a
    sequence alone is below the machine's balance (f1 / k1 <= peak / bandwidth): then no
    batch is compute-bound, since every sequence brings more bytes than FLOPs.
    """
    w, f1, k1 = _per_sequence(cfg, s_cached, **kw)
    margin = f1 / machine.peak_flops_per_s - k1 / machine.bandwidth_bytes_per_s
    return (w / machine.bandwidth_bytes_per_s) / margin if margin > 0 else math.inf


def weights_critical_batch(cfg: GPTConfig, machine: Machine, *, dtype: torch.dtype | str = torch.float32) -> float:
    """The batch from which the products with weights alone are compute-bound: 2 B P / peak = weight bytes / bandwidth.

    About bytes-per-weight x balance / 2, whatever the context: the weights are read once
    for the whole batch and each does 2 FLOPs per sequence.
    """
    cost = decode_cost(cfg, 0, 1, dtype=dtype)
    return (cost.weight_bytes / machine.bandwidth_bytes_per_s) / (cost.flops_linear / machine.peak_flops_per_s)


def context_limit(cfg: GPTConfig, machine: Machine, **kw) -> float:
    """The cached length S beyond which no batch makes a decode step compute-bound (`critical_batch` is infinite).

    A sequence's FLOPs and bytes both grow linearly with S; each cached key brings
    4 H D FLOPs per layer for 2 Hkv D elements read, an intensity of 2 (H / Hkv) / bytes
    per element, far below a CPU's or GPU's balance in float32. Returns `math.inf` if that
    never happens, 0.0 if it already holds at S = 0.
    """
    _, f0, k0 = _per_sequence(cfg, 0, **kw)
    _, f1, k1 = _per_sequence(cfg, 1, **kw)
    peak, bw = machine.peak_flops_per_s, machine.bandwidth_bytes_per_s
    at0, slope = f0 / peak - k0 / bw, (f1 - f0) / peak - (k1 - k0) / bw  # margin(S) = at0 + slope * S
    if at0 <= 0:
        return 0.0
    return -at0 / slope if slope < 0 else math.inf
