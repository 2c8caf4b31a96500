"""The decode step a compiler can fuse: static buffers, fused weights, one function per step.

Introduced in chapter 7, the course's fast path. `FusedDecode` is the cached decode step of
any course model without a sliding window or a latent (GPT-2 or Llama-family, GQA,
cross-layer sharing) written the way engines write it: Q, K and V come out of one fused
projection (and the SwiGLU gate and up of another), the keys and values live in one
preallocated buffer per layer, the new position is written in place, and one query attends
(eager through `scaled_dot_product_attention`, compiled as the reductions it is,
`attend_by_reductions`). Its shapes depend only on the batch, the capacity and the number
of keys read, so `torch.compile` turns the whole step into one graph that inductor fuses
(`compiled()`); the number of keys is the one size it takes as a symbol (every other size
stays a number, as inductor's own product kernels need), by default with the weights frozen
into the graph and packed for the matrix-vector kernels inductor picks (`packing`). The test
command proves the eager step equal to the model both ways of attending (float64, 1e-12),
with its weights held as the constants a packed compile takes too; the benchmark
(`labcode.bench.compiled`) times it eager and compiled, with its weights as stored and packed.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from labcode.caches import WindowCache
from labcode.checks import fail
from labcode.model import GPT


def _norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, eps: float, rms: bool) -> torch.Tensor:
    if rms:
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    return F.layer_norm(x, (x.shape[-1],), w, b, eps)


def _rotate_one(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary turn of x [B, H, D] at one position (cos, sin [D/2]): the pairs (i, i + D/2), as the model's."""
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def attend_by_reductions(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One query per head, q [B, H, D], against keys and values [B, Hkv, T, D] (H a multiple of Hkv, the query heads
    of a group side by side): the scores as products summed over D, their softmax over T, and the values summed
    with those weights over T, [B, H, D]. Written as reductions, not a library call, so that a compiler fuses the
    three into one loop nest per layer that reads each key and value once."""
    b, h, d = q.shape
    hkv = k.shape[1]
    q = (q * d**-0.5).view(b, hkv, h // hkv, 1, d)
    p = torch.softmax((q * k.unsqueeze(2)).sum(-1), dim=-1)  # (B, Hkv, H / Hkv, T)
    return (p.unsqueeze(-1) * v.unsqueeze(2)).sum(-2).reshape(b, h, d)


def packing():
    """Inductor's freezing and its kernel choice (`max_autotune`), for the block in which a compiled function traces and
    compiles: the parameters it reads become constants of its graph, and each weight of a product is packed once
    into the order its chosen kernel streams (a library product reads a weight as it is stored). Dynamo reads the
    setting while it traces, so the block must hold the first call (and any call that recompiles). The kernels it
    writes are named for the profiler (`cpp.enable_kernel_profile`), as the library's products are, and the timings
    of its choice are not printed."""
    import torch._inductor.config as inductor

    return inductor.patch({"freezing": True, "max_autotune": True, "cpp.enable_kernel_profile": True,
                           "autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False})


class FusedDecode:
    """One cached decode position of `model` at batch `batch`, into buffers of `capacity` positions.

    `prefill(ids)` fills the buffers with the model's own pass; `step(ids [B, 1]) -> logits [B, V]`
    decodes one position, writes its K/V at `self.position` and advances it. `step_fn` is the
    pure function of (ids, position, keys) the compiler sees; `attention` is how its query
    attends ("sdpa", or "reductions": `attend_by_reductions`, what `compiled()` sets); `compiled()`
    swaps in its compiled form and returns the seconds the first calls took. A fused weight keeps the
    storage order of its first part, or is stored column by column where `by_column(out, in)`
    says so for its own shape (the benchmark passes its layout rule, `labcode.bench.layout`).
    """

    def __init__(self, model: GPT, capacity: int | None = None, batch: int = 1, concat: bool = False,
                 by_column: Callable[[int, int], bool] | None = None) -> None:
        cfg = model.cfg
        if cfg.sliding_window is not None or cfg.kv_latent is not None:
            fail("FusedDecode model", "full attention with K/V heads (no sliding window, no latent)",
                 f"sliding_window={cfg.sliding_window}, kv_latent={cfg.kv_latent}")
        capacity = cfg.context_length if capacity is None else capacity
        if not 0 < capacity <= cfg.context_length:
            fail("FusedDecode capacity", f"1..context_length {cfg.context_length}", capacity)
        self.model, self.cfg, self.capacity, self.batch, self.concat = model, cfg, capacity, batch, concat
        self.rms, self.swiglu = cfg.norm == "rmsnorm", cfg.mlp == "swiglu"
        dev, dt = model.device, model.dtype

        def w(t):
            return None if t is None else t.detach()

        def cat(*ts):  # a fused weight: its first part's storage order, or by column where `by_column` says
            out = torch.cat([t.detach() for t in ts])
            column = out.dim() == 2 and (ts[0].stride(0) == 1 or (by_column is not None and by_column(*out.shape)))
            return out.t().contiguous().t() if column else out

        self.layers = []
        with torch.no_grad():
            for b in model.blocks:
                a = b.attn
                qkv_w = a.q_proj.weight if a.kv_proj is None else cat(a.q_proj.weight, a.kv_proj.weight)
                qkv_b = None if a.q_proj.bias is None else (
                    a.q_proj.bias if a.kv_proj is None else cat(a.q_proj.bias, a.kv_proj.bias))
                if self.swiglu:
                    up_w = cat(b.mlp.gate.weight, b.mlp.up.weight)
                    up_b = None if b.mlp.gate.bias is None else cat(b.mlp.gate.bias, b.mlp.up.bias)
                    down_w, down_b = b.mlp.down.weight, b.mlp.down.bias
                else:
                    up_w, up_b, down_w, down_b = b.mlp[0].weight, b.mlp[0].bias, b.mlp[2].weight, b.mlp[2].bias
                self.layers.append({"ln1": (w(b.ln_1.weight), w(getattr(b.ln_1, "bias", None))),
                                    "ln2": (w(b.ln_2.weight), w(getattr(b.ln_2, "bias", None))),
                                    "qkv": (w(qkv_w), w(qkv_b)), "out": (w(a.out_proj.weight), w(a.out_proj.bias)),
                                    "up": (w(up_w), w(up_b)), "down": (w(down_w), w(down_b)),
                                    "owns": a.kv_proj is not None})
        self.lnf = (w(model.ln_f.weight), w(getattr(model.ln_f, "bias", None)))
        self.emb = model.tok_emb.weight.detach()
        self.pos_emb = None if model.pos_emb is None else model.pos_emb.weight.detach()
        hkv, d = cfg.n_kv_heads, cfg.head_dim
        # one buffer per cache layer, [B, Hkv, capacity, D]: each written one row per step, in place (made in
        # inference mode, as every tensor the step sees: the compiled step checks that it is the same kind)
        with torch.inference_mode():
            self.k = [torch.zeros(batch, hkv, capacity, d, device=dev, dtype=dt) for _ in range(cfg.kv_layers)]
            self.v = [torch.zeros_like(k) for k in self.k]
        if cfg.rotary:  # the model's angles: positions times frequencies in float64, cos and sin cast after
            inv = cfg.rope_base ** (-torch.arange(0, d, 2, device=dev, dtype=torch.float64) / d)
            ang = torch.arange(capacity, device=dev, dtype=torch.float64).unsqueeze(-1) * inv
            self.cos, self.sin = ang.cos().to(dt), ang.sin().to(dt)
        self.full = (self.k, self.v)  # concat: the rows are views of these, and a step makes new tensors
        if concat:
            self.reset(0)
        self.gqa = bool(cfg.n_heads != hkv)  # a plain bool: the compiler must not make it a symbol
        self.position = 0
        self.attention = "sdpa"
        with torch.inference_mode():  # the number of keys a step reads: the length of a view of this
            self.lengths = torch.empty(capacity, device=dev, dtype=dt)
        self.fn = self.step_fn

    def reset(self, position: int = 0) -> None:
        """Go back to `position` (the rows before it as the buffers hold them): timings restart from one state."""
        self.position = position
        if self.concat:
            with torch.inference_mode():  # contiguous, as every tensor a concatenating step makes
                self.k = [k[:, :, :position].contiguous() for k in self.full[0]]
                self.v = [v[:, :, :position].contiguous() for v in self.full[1]]

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """Fill the buffers from a prompt ids [B, T] with the model's pass; return its last logits [B, V]."""
        b, t = ids.shape
        if b != self.batch or self.position + t > self.capacity:
            fail("prefill ids", f"[{self.batch}, <= {self.capacity - self.position}]", tuple(ids.shape))
        cache = WindowCache(self.cfg.kv_layers, self.capacity)
        if self.position:
            fail("prefill", "an empty step (reset() first)", f"position {self.position}")
        logits = self.model(ids, cache)
        for layer in range(self.cfg.kv_layers):
            self.full[0][layer][:, :, :t] = cache.k[layer][:, :, :t]
            self.full[1][layer][:, :, :t] = cache.v[layer][:, :, :t]
        self.reset(t)
        return logits[:, -1]

    @torch.inference_mode()
    def step(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] of one new position ids [B, 1]; its K/V written at `position`, which advances."""
        n = self.position
        if tuple(ids.shape) != (self.batch, 1):
            fail("step ids", f"shape ({self.batch}, 1)", tuple(ids.shape))
        if n >= self.capacity:
            fail("step", f"a free position (capacity {self.capacity})", f"position {n}")
        pos = torch.tensor([n], device=ids.device)  # the write position, as a tensor
        keys = self.lengths[: n + 1]  # the number of keys, as the one size the compiler takes as a symbol
        torch._dynamo.maybe_mark_dynamic(keys, 0)
        if self.concat:  # and the rows a concatenating step is handed
            for t in self.k + self.v:
                torch._dynamo.maybe_mark_dynamic(t, 2)
        out = self.fn(ids.clone(memory_format=torch.contiguous_format), pos, keys)
        self.position = n + 1
        return out

    def step_fn(self, ids: torch.Tensor, pos: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """The pure step: embed, every block, the head. Writes row `pos` [1] of every layer's K and V and
        attends to as many rows as `keys` is long (pos + 1; the compiler sees one symbol for that length, not one
        graph per step, and every other size as the number it is)."""
        cfg, eps, rms, keys = self.cfg, self.cfg.norm_eps, self.rms, keys.shape[0]
        b, h, hkv, d = self.batch, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        x = F.embedding(ids[:, 0], self.emb)  # (B, C)
        if self.pos_emb is not None:
            x = x + self.pos_emb[pos]
        if cfg.rotary:
            cos, sin = self.cos[pos], self.sin[pos]  # (1, D/2)
        for i, lay in enumerate(self.layers):
            slot = i // cfg.kv_share
            a = _norm(x, *lay["ln1"], eps, rms)
            qkv = F.linear(a, *lay["qkv"])  # (B, H D + 2 Hkv D): one weight read for Q, K and V
            q = qkv[:, : h * d].view(b, h, d)
            if cfg.rotary:
                q = _rotate_one(q, cos, sin)
            if lay["owns"]:
                k_new, v_new = qkv[:, h * d :].view(b, 2, hkv, d).unbind(1)  # (B, Hkv, D) each
                if cfg.rotary:
                    k_new = _rotate_one(k_new, cos, sin)
                if self.concat:  # a new tensor of n + 1 rows: every cached row copied, every step
                    self.k[slot] = torch.cat((self.k[slot], k_new.unsqueeze(2)), 2)
                    self.v[slot] = torch.cat((self.v[slot], v_new.unsqueeze(2)), 2)
                else:  # one row written in place
                    self.k[slot].index_copy_(2, pos, k_new.unsqueeze(2))
                    self.v[slot].index_copy_(2, pos, v_new.unsqueeze(2))
            k_all, v_all = self.k[slot][:, :, :keys], self.v[slot][:, :, :keys]  # (B, Hkv, keys, D): views
            if self.attention == "reductions":
                y = attend_by_reductions(q, k_all, v_all)  # (B, H, D)
            else:
                y = F.scaled_dot_product_attention(q.unsqueeze(2), k_all, v_all, enable_gqa=self.gqa)  # (B, H, 1, D)
            x = x + F.linear(y.reshape(b, h * d), *lay["out"])
            m = _norm(x, *lay["ln2"], eps, rms)
            up = F.linear(m, *lay["up"])
            if self.swiglu:
                gate, up = up.chunk(2, dim=-1)
                up = F.silu(gate) * up
            else:
                up = F.gelu(up, approximate="tanh")
            x = x + F.linear(up, *lay["down"])
        return F.linear(_norm(x, *self.lnf, eps, rms), self.emb)  # (B, V), the tied head

    def freeze_weights(self) -> None:
        """Hold every weight as a parameter that needs no gradient (the same tensors, not copies): what inductor's
        freezing takes as a constant of the graph. The buffers and the rotary angles stay inputs."""
        def const(t):
            return t if t is None or isinstance(t, torch.nn.Parameter) else torch.nn.Parameter(t, requires_grad=False)

        for lay in self.layers:
            for key in ("ln1", "ln2", "qkv", "out", "up", "down"):
                lay[key] = tuple(const(t) for t in lay[key])
        self.lnf, self.emb, self.pos_emb = tuple(const(t) for t in self.lnf), const(self.emb), const(self.pos_emb)

    @torch.inference_mode()
    def compiled(self, mode: str | None = None, packed: bool = True) -> float:
        """Compile `step_fn` (inductor, the number of keys a symbol); return the seconds its first two calls took.

        Attention becomes `attend_by_reductions`, which inductor fuses with the softmax. `dynamic=False` keeps every
        size fixed but the one marked dynamic, the number of keys (`dynamic=True` would make a symbol of every
        integer the step reads, the model's width too, and so would the default once two models compiled the same
        code; inductor's product kernels take only fixed sizes). `packed`: the weights are frozen
        into the graph (`freeze_weights`, `packing`), and inductor stores each once, at compile time, in the blocked
        order of its own matrix-vector kernel, which it picks where it is faster than the library's. The first calls,
        which compile, run at two scratch positions near the end, then the buffers and the position are put back; a
        later call that recompiled (a number of keys below 2, or every row of the buffer) would get a graph without
        packing."""
        # every FusedDecode compiles the same code for its own tensors: room for all of them in the code cache
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        if packed:
            self.freeze_weights()
        self.attention = "reductions"
        self.fn = torch.compile(self.step_fn, dynamic=False, mode=mode, fullgraph=True)
        keep, position = [t.clone() for t in self.full[0] + self.full[1]], self.position
        ids = torch.zeros(self.batch, 1, dtype=torch.long, device=self.model.device)
        t0 = time.perf_counter()
        with packing() if packed else contextlib.nullcontext():
            for n in (self.capacity - 3, self.capacity - 2):
                self.reset(n)
                self.step(ids)
        seconds = time.perf_counter() - t0
        for buf, kept in zip(self.full[0] + self.full[1], keep, strict=True):
            buf.copy_(kept)
        self.reset(position)
        return seconds
