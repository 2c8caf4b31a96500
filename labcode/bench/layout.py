"""Weight layouts for decode speed: the benchmark's models store their wide weights column by column.

Introduced in chapter 7. A decode step multiplies one row by each weight matrix, so it runs at the speed the weights
stream from memory; for wide matrices [out, in] (the tied head above all) the library reads one stored column by
column markedly faster. The model keeps PyTorch's default layout; the benchmark's layout table times both.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from labcode.config import GPTConfig
from labcode.fused import FusedDecode
from labcode.model import GPT

WIDE_MIN_ELEMENTS = 1 << 16  # smaller matrices keep the default layout: the tiny model's, which its caches hold


def by_column(n_out: int, n_in: int, min_elements: int = WIDE_MIN_ELEMENTS) -> bool:
    """Whether the benchmark stores a weight [n_out, n_in] column by column: wide and large."""
    return n_out > n_in and n_out * n_in >= min_elements


def weight_shapes(cfg: GPTConfig) -> set[tuple[int, int]]:
    """The shapes [out, in] of a decode step's products with weights for a model of `cfg`: every weight matrix
    but the position table, and the stacked ones of the fused step (Q/K/V, SwiGLU's gate and up), read off the
    model and its `FusedDecode` built on the meta device (shapes only: no memory, no initialisation)."""
    with torch.device("meta"):
        model = GPT(cfg)
    fused = FusedDecode(model, 1)
    shapes = {tuple(p.shape) for n, p in model.named_parameters() if p.dim() == 2 and "pos_emb" not in n}
    return shapes | {tuple(layer[k][0].shape) for layer in fused.layers for k in ("qkv", "out", "up", "down")}


def store_wide_weights_by_column(model: GPT, min_elements: int = WIDE_MIN_ELEMENTS) -> GPT:
    """Store `model`'s large wide weights [out, in] column by column, in place (shapes, values and state_dict
    unchanged; square, tall and small matrices keep PyTorch's default layout); return the model."""
    with torch.no_grad():
        for p in [model.tok_emb.weight] + [m.weight for m in model.modules() if isinstance(m, nn.Linear)]:
            if by_column(*p.shape, min_elements):
                p.data = p.data.t().contiguous().t()  # (out, in) with strides (1, out)
    return model


def row_major_copy(model: GPT) -> GPT:
    """A copy of `model` whose every weight is stored row by row (PyTorch's default layout)."""
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.data = p.data.contiguous()
    return other
