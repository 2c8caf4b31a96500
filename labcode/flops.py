"""Counting floating-point operations: formulas, and measurements with FlopCounterMode.

Introduced in chapter 7. The formulas count what `torch.utils.flop_counter` counts:
matrix products only (a multiply and an add are two FLOPs); biases, softmax,
LayerNorm and GELU are left out. The attention products are dense: the full forward
also multiplies the masked-out query-key pairs, so their cost is counted too.
"""

from __future__ import annotations

from collections.abc import Callable

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


def forward_flops(cfg: GPTConfig, t_new: int, s_cached: int = 0, batch: int = 1) -> int:
    """FLOPs of one forward call: T new positions after S cached ones."""
    return linear_flops(cfg, t_new, batch) + attention_flops(cfg, t_new, s_cached + t_new, batch)


def generation_flops(cfg: GPTConfig, prompt_len: int, new_tokens: int, cached: bool,
                     batch: int = 1) -> list[int]:
    """FLOPs of each forward call of a greedy generation of `new_tokens` after a prompt of P tokens.

    Without a cache call i runs all P + i positions; with one, the first call runs the
    prompt and each later call one position after P + i - 1 cached ones (the last token
    is never fed back), as `labcode.generate` does.
    """
    if new_tokens <= 0:
        return []
    if not cached:
        return [forward_flops(cfg, prompt_len + i, 0, batch) for i in range(new_tokens)]
    return [forward_flops(cfg, prompt_len, 0, batch)] + [
        forward_flops(cfg, 1, prompt_len + i - 1, batch) for i in range(1, new_tokens)
    ]


def attention_sum(cfg: GPTConfig, n: int, cached: bool) -> int:
    """Attention FLOPs summed over steps t = 1..n: sum 4LHD t^2 (O(n^3 D)) or, cached, sum 4LHD t (O(n^2 D))."""
    unit = 4 * cfg.n_layers * cfg.n_heads * cfg.head_dim
    if cached:
        return unit * n * (n + 1) // 2
    return unit * n * (n + 1) * (2 * n + 1) // 6


def linear_sum(cfg: GPTConfig, n: int, cached: bool) -> int:
    """Linear-layer FLOPs summed over steps t = 1..n: 2 P t each (O(n^2 C^2)) or, cached, 2 P (O(n C^2))."""
    per_position = 2 * linear_params(cfg)
    return per_position * (n * (n + 1) // 2 if not cached else n)


def measure_flops(fn: Callable[[], object]) -> tuple[int, dict[str, int]]:
    """Run `fn()` under FlopCounterMode; return the total FLOPs and the FLOPs per aten operator."""
    with FlopCounterMode(display=False) as counter:
        fn()
    per_op = {str(op).removeprefix("aten."): int(n) for op, n in counter.get_flop_counts().get("Global", {}).items()}
    return int(counter.get_total_flops()), per_op
