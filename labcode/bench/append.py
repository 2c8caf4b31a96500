"""Benchmarks of appending to a cache, alone and followed by single-token attention.

Introduced in chapter 7. The setup has the cache shapes of SmolLM2-135M, the course's real model (30 layers, 3 K/V
heads, head dim 64), in float32: a prefill, then one token per decode step; only the cache work is timed, no model runs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from labcode.attention import repeat_kv_attention
from labcode.bench.common import TIMED, Sizes, bar
from labcode.bench.timing import median, rotated, timed
from labcode.caches import ConcatCache, GrowableCache, RingCache, WindowCache
from labcode.model import attend
from labcode.results import QAResult


@dataclass(frozen=True)
class AppendSetup:
    """Shapes of an append benchmark: L layers of [B, Hkv, S, D] keys and values."""

    name: str
    prefill: int  # P: positions written before the first timed step
    decode: int  # timed steps, one new position each
    n_layers: int = 30
    n_kv_heads: int = 3
    n_heads: int = 9  # query heads, for the attention benchmark (GQA groups of n_heads / n_kv_heads)
    head_dim: int = 64
    batch: int = 1
    grow_start: int = 64  # first capacity (and linear step) of the growable caches


KINDS = ("cat", "slice", "ring", "grow_linear", "grow_double", "bare_cat", "bare_slice", "fused_slice")


class CourseAppender:
    """A `labcode.caches` object fed the way the model feeds it: begin, one append per layer, end."""

    def __init__(self, cache) -> None:
        self.cache = cache

    def step(self, k: torch.Tensor, v: torch.Tensor, kv_all: torch.Tensor | None = None) -> None:
        self.cache.feed(k, v)

    prefill = step  # the prompt is fed as one chunk, the way a step is

    def last_layer(self) -> torch.Tensor:
        """Keys of the last layer in time order, [B, Hkv, S, D]."""
        return self.cache.read(self.cache.n_layers - 1)[0]


class BareCat:
    """`torch.cat` per layer with nothing around it: the cost of concatenation alone."""

    def __init__(self, n_layers: int) -> None:
        self.n_layers = n_layers

    def prefill(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v = [k] * self.n_layers, [v] * self.n_layers

    def step(self, k: torch.Tensor, v: torch.Tensor, kv_all: torch.Tensor) -> None:
        for layer in range(self.n_layers):
            self.k[layer] = torch.cat((self.k[layer], k), dim=2)  # (B, Hkv, S+1, D)
            self.v[layer] = torch.cat((self.v[layer], v), dim=2)

    def last_layer(self) -> torch.Tensor:
        return self.k[-1]


class BareSlice:
    """Preallocated buffers and one `narrow(...).copy_()` per tensor: a slice write with no checks."""

    def __init__(self, n_layers: int, capacity: int, like: torch.Tensor) -> None:
        b, hkv, _, d = like.shape
        self.k = [like.new_zeros(b, hkv, capacity, d) for _ in range(n_layers)]  # (B, Hkv, N, D)
        self.v = [like.new_zeros(b, hkv, capacity, d) for _ in range(n_layers)]
        self.n = 0

    def prefill(self, k: torch.Tensor, v: torch.Tensor) -> None:
        p = k.shape[2]
        for kb, vb in zip(self.k, self.v, strict=True):
            kb.narrow(2, 0, p).copy_(k)
            vb.narrow(2, 0, p).copy_(v)
        self.n = p

    def step(self, k: torch.Tensor, v: torch.Tensor, kv_all: torch.Tensor) -> None:
        n = self.n
        for kb, vb in zip(self.k, self.v, strict=True):
            kb.narrow(2, n, 1).copy_(k)
            vb.narrow(2, n, 1).copy_(v)
        self.n = n + 1

    def last_layer(self) -> torch.Tensor:
        return self.k[-1][:, :, : self.n]


class FusedSlice:
    """One buffer [L, 2, B, Hkv, N, D] and one copy per step for every layer at once: a lower bound, not a design (in
    a real forward each layer's K/V exist only after the layer below has run)."""

    def __init__(self, n_layers: int, capacity: int, like: torch.Tensor) -> None:
        b, hkv, _, d = like.shape
        self.buf = like.new_zeros(n_layers, 2, b, hkv, capacity, d)  # (L, 2, B, Hkv, N, D)
        self.n = 0

    def prefill(self, k: torch.Tensor, v: torch.Tensor) -> None:
        p = k.shape[2]
        self.buf[:, 0, :, :, :p] = k
        self.buf[:, 1, :, :, :p] = v
        self.n = p

    def step(self, k: torch.Tensor, v: torch.Tensor, kv_all: torch.Tensor) -> None:
        self.buf.narrow(4, self.n, 1).copy_(kv_all)  # kv_all (L, 2, B, Hkv, 1, D)
        self.n += 1

    def last_layer(self) -> torch.Tensor:
        return self.buf[-1, 0, :, :, : self.n]


def make_appender(kind: str, setup: AppendSetup, like: torch.Tensor):
    """A fresh appender of `kind` (one of KINDS) able to hold prefill + decode positions."""
    cap, n = setup.prefill + setup.decode, setup.n_layers
    makers = {"cat": lambda: CourseAppender(ConcatCache(n)), "slice": lambda: CourseAppender(WindowCache(n, cap)),
              "ring": lambda: CourseAppender(RingCache(n, cap)),
              "grow_linear": lambda: CourseAppender(GrowableCache(n, setup.grow_start, "linear")),
              "grow_double": lambda: CourseAppender(GrowableCache(n, setup.grow_start, "double")),
              "bare_cat": lambda: BareCat(n), "bare_slice": lambda: BareSlice(n, cap, like),
              "fused_slice": lambda: FusedSlice(n, cap, like)}
    return makers[kind]()


def _step_data(setup: AppendSetup, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """The prefill K/V and, per decode step, (k, v, kv_all): made before timing starts."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    shape = (setup.batch, setup.n_kv_heads, setup.prefill, setup.head_dim)
    k0, v0 = (torch.randn(shape, generator=gen, dtype=dtype).to(device) for _ in range(2))
    steps = []
    for _ in range(setup.decode):
        k, v = (torch.randn(shape[:2] + (1, shape[3]), generator=gen, dtype=dtype).to(device) for _ in range(2))
        kv_all = torch.stack((k, v)).unsqueeze(0).expand(setup.n_layers, -1, -1, -1, -1, -1).contiguous()
        steps.append((k, v, kv_all))  # k, v (B, Hkv, 1, D); kv_all (L, 2, B, Hkv, 1, D)
    return (k0, v0), steps


def _medians(setup: AppendSetup, times: dict) -> dict:
    """The setup, the cache length after each step, and the median seconds of each step and overall per contender."""
    per_step = {n: [median(ts) for ts in t] for n, t in times.items()}
    return {"setup": asdict(setup), "cache_length": [setup.prefill + i + 1 for i in range(setup.decode)],
            "per_step_s": per_step, "median_step_s": {n: median(s) for n, s in per_step.items()}}


def bench_append(setup: AppendSetup, kinds: list[str], rounds: int, device: torch.device,
                 dtype: torch.dtype = torch.float32, progress=None) -> dict:
    """Per-step seconds of appending one position to all layers, for each kind, interleaved step by step, each
    appender rebuilt every round after a discarded warm-up round. Returns `_medians` and a content check."""
    (k0, v0), steps = _step_data(setup, device, dtype)
    times = {kind: [[] for _ in steps] for kind in kinds}
    max_diff = 0.0
    for r in range(rounds + 1):
        apps = {kind: make_appender(kind, setup, k0) for kind in kinds}
        for app in apps.values():
            app.prefill(k0, v0)
        for i, (k, v, kv_all) in enumerate(steps):
            for kind in rotated(kinds, i + r):
                t = timed(lambda app=apps[kind], k=k, v=v, kv_all=kv_all: app.step(k, v, kv_all), device)
                if r > 0:
                    times[kind][i].append(t)
            if progress is not None:
                progress.update(1)
        ref = apps[kinds[0]].last_layer()
        max_diff = max([max_diff] + [float((a.last_layer() - ref).abs().max()) for a in apps.values()])
        del apps
    return {**_medians(setup, times), "max_content_diff": max_diff}


ATTENTION = {"repeat_kv": repeat_kv_attention, "gqa": lambda q, k, v: attend(q, k, v, None),
             "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)}


def bench_append_attention(setup: AppendSetup, caches: list[str], rounds: int, device: torch.device,
                           dtype: torch.dtype = torch.float32, progress=None) -> dict:
    """Per-step seconds of append plus one-token attention in every layer, for each cache x attention method."""
    (k0, v0), steps = _step_data(setup, device, dtype)
    gen = torch.Generator(device="cpu").manual_seed(1)
    q = torch.randn(setup.batch, setup.n_heads, 1, setup.head_dim, generator=gen, dtype=dtype).to(device)
    combos = [f"{c}/{m}" for c in caches for m in ATTENTION]
    times = {combo: [[] for _ in steps] for combo in combos}
    outputs: dict[str, torch.Tensor] = {}
    for r in range(rounds + 1):
        cache_objs = {combo: make_appender(combo.split("/")[0], setup, k0).cache for combo in combos}
        for cache in cache_objs.values():
            cache.feed(k0, v0)
        for i, (k, v, _) in enumerate(steps):
            for combo in rotated(combos, i + r):
                cache, method = cache_objs[combo], ATTENTION[combo.split("/")[1]]

                def step(cache=cache, method=method, combo=combo, k=k, v=v):
                    cache.begin(k.shape, k.dtype, k.device)
                    for layer in range(cache.n_layers):
                        outputs[combo] = method(q, *cache.append(layer, k, v))  # (B, H, 1, D)
                    cache.end()

                t = timed(step, device)
                if r > 0:
                    times[combo][i].append(t)
            if progress is not None:
                progress.update(1)
    ref = outputs[combos[0]]
    return {**_medians(setup, times), "max_output_diff": max(float((o - ref).abs().max()) for o in outputs.values())}


def record(res: QAResult, sizes: Sizes, device: torch.device, progress: bool) -> None:
    """The append benchmarks, one position into every layer (`append`), and append plus attention."""
    append = {}
    for name, prefill in zip(("candle", "long"), sizes.append_prefills, strict=True):
        setup = AppendSetup(name, prefill, sizes.append_decode, n_layers=sizes.append_layers)
        with bar((sizes.append_rounds + 1) * setup.decode, f"append {name}", progress) as shown:
            append[name] = bench_append(setup, list(KINDS), sizes.append_rounds, device, progress=shown)
    res.value("append", append, TIMED)
    setup = AppendSetup("candle", sizes.append_prefills[0], sizes.attention_decode, n_layers=sizes.append_layers)
    with bar((sizes.attention_rounds + 1) * setup.decode, "append + attention", progress) as shown:
        res.value("append_attention", bench_append_attention(setup, ["cat", "slice"], sizes.attention_rounds,
                                                             device, progress=shown), TIMED)
