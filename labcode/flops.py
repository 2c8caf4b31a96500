"""Counting floating-point operations: formulas, and measurements with FlopCounterMode.

Introduced in chapter 7. The formulas count what `torch.utils.flop_counter` counts:
matrix products only (a multiply and an add are two FLOPs); biases, softmax,
LayerNorm and GELU are left out. The attention products are dense: the full forward
also multiplies the masked-out query-key pairs, so their cost is counted too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from labcode.config import GPTConfig


def linear_params(cfg: GPTConfig) -> int:
    """Weights that multiply each position once: L blocks of Q, K/V, output and MLP, plus the tied head."""
    c, kv = cfg.d_model, 2 * cfg.n_kv_heads * cfg.head_dim
    per_block = c * cfg.n_heads * cfg.head_dim + c * kv + c * c + 2 * 4 * c * c  # q, kv, out, mlp in and out
    return cfg.n_layers * per_block + c * cfg.vocab_size


def linear_flops(cfg: GPTConfig, t_new: int, batch: int = 1) -> int:
    """FLOPs of the linear layers for T new positions: 2 * B * T * (weights per position)."""
    return 2 * batch * t_new * linear_params(cfg)


def attention_flops(cfg: GPTConfig, t_new: int, s_total: int, batch: int = 1) -> int:
    """FLOPs of QK^T and weights @ V in all layers: T queries against S_total keys, 4 * B * H * T * S_total * D each."""
    return cfg.n_layers * 4 * batch * cfg.n_heads * t_new * s_total * cfg.head_dim


def head_flops(cfg: GPTConfig, rows: int, batch: int = 1) -> int:
    """FLOPs of the tied output head for `rows` positions of each sequence: 2 * B * rows * C * V."""
    return 2 * batch * rows * cfg.d_model * cfg.vocab_size


def _logit_rows(logits: str, t_new: int) -> int:
    if logits not in ("all", "last"):
        raise ValueError(f"logits: expected 'all' or 'last', got {logits!r}")
    return t_new if logits == "all" else 1


def forward_flops(cfg: GPTConfig, t_new: int, s_cached: int = 0, batch: int = 1, logits: str = "all") -> int:
    """FLOPs of one forward call: T new positions after S cached ones.

    `logits="all"` counts the head on every new position, as the course's model computes it;
    `"last"` on the last one only, as a generation loop needs (see `head_on_last_row`).
    """
    skipped = head_flops(cfg, t_new - _logit_rows(logits, t_new), batch)
    return linear_flops(cfg, t_new, batch) - skipped + attention_flops(cfg, t_new, s_cached + t_new, batch)


def generation_flops(cfg: GPTConfig, prompt_len: int, new_tokens: int, cached: bool,
                     batch: int = 1, logits: str = "all") -> list[int]:
    """FLOPs of each forward call of a greedy generation of `new_tokens` after a prompt of P tokens.

    Without a cache call i runs all P + i positions; with one, the first call runs the
    prompt and each later call one position after P + i - 1 cached ones (the last token
    is never fed back), as `labcode.generate` does. `logits` as in `forward_flops`.
    """
    if new_tokens <= 0:
        return []
    if not cached:
        return [forward_flops(cfg, prompt_len + i, 0, batch, logits) for i in range(new_tokens)]
    return [forward_flops(cfg, prompt_len, 0, batch, logits)] + [
        forward_flops(cfg, 1, prompt_len + i - 1, batch, logits) for i in range(1, new_tokens)
    ]


def attention_sum(cfg: GPTConfig, n: int, cached: bool) -> int:
    """Attention FLOPs summed over steps t = 1..n: sum 4LHD t^2 (O(n^3 D)) or, cached, sum 4LHD t (O(n^2 D))."""
    unit = 4 * cfg.n_layers * cfg.n_heads * cfg.head_dim
    if cached:
        return unit * n * (n + 1) // 2
    return unit * n * (n + 1) * (2 * n + 1) // 6


def linear_sum(cfg: GPTConfig, n: int, cached: bool, logits: str = "all") -> int:
    """Linear-layer FLOPs summed over steps t = 1..n: 2 P t each (O(n^2 C^2)) or, cached, 2 P (O(n C^2)).

    With `logits="last"` the uncached step t multiplies only one row by the head: 2 (P - CV) t + 2 CV.
    """
    per_position = 2 * linear_params(cfg)
    if cached:
        return per_position * n
    skipped = 0 if _logit_rows(logits, 2) == 2 else head_flops(cfg, n * (n + 1) // 2 - n)
    return per_position * (n * (n + 1) // 2) - skipped


@contextmanager
def head_on_last_row(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block, `model` multiplies only the last position of each call by its output head.

    Its logits are then [B, 1, V]: the last row of what it returns otherwise. A generation
    loop reads nothing else (Hugging Face's `generate` passes `logits_to_keep=1` for this).
    Done with a hook that keeps the last row of the final LayerNorm's output.
    """
    handle = model.ln_f.register_forward_hook(lambda _module, _inputs, out: out[:, -1:])
    try:
        yield model
    finally:
        handle.remove()


def measure_flops(fn: Callable[[], object]) -> tuple[int, dict[str, int]]:
    """Run `fn()` under FlopCounterMode; return the total FLOPs and the FLOPs per aten operator."""
    with FlopCounterMode(display=False) as counter:
        fn()
    per_op = {str(op).removeprefix("aten."): int(n) for op, n in counter.get_flop_counts().get("Global", {}).items()}
    return int(counter.get_total_flops()), per_op
