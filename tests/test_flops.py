"""The head on the last row only (chapter 7, issue 12's no-cache baseline): what a generation loop needs,
measured with FlopCounterMode against the formulas, and the same logits as the full head's last row."""

from __future__ import annotations

import pytest
import torch

from labcode import GPT, get_config
from labcode.caches import ConcatCache
from labcode.flops import (
    attention_sum,
    forward_flops,
    generation_flops,
    head_flops,
    head_on_last_row,
    linear_params,
    linear_sum,
    measure_flops,
)
from labcode.generate import generate, generate_nocache


def _model(cfg, dtype=torch.float32):
    torch.manual_seed(0)
    return GPT(cfg).to(dtype).eval()


def test_head_flops_by_hand():
    micro = get_config("micro")  # C = 16, V = 64
    assert head_flops(micro, 3, batch=2) == 2 * 2 * 3 * 16 * 64
    assert forward_flops(micro, 5, logits="last") == forward_flops(micro, 5) - 4 * 2 * 16 * 64
    assert forward_flops(micro, 1, 7, logits="last") == forward_flops(micro, 1, 7)  # one row: nothing to skip
    with pytest.raises(ValueError, match="logits: expected 'all' or 'last', got 'first'"):
        forward_flops(micro, 5, logits="first")


@pytest.mark.parametrize("name,batch,t", [("micro", 1, 1), ("micro", 2, 9), ("tiny", 3, 12)])
def test_last_row_head_is_the_full_heads_last_row_and_counts_as_the_formula(name, batch, t):
    cfg = get_config(name)
    model = _model(cfg, torch.float64)
    ids = torch.randint(0, cfg.vocab_size, (batch, t), generator=torch.Generator().manual_seed(t))
    with torch.inference_mode():
        full, full_flops = model(ids), measure_flops(lambda: model(ids))[0]
        with head_on_last_row(model):
            last, last_flops = model(ids), measure_flops(lambda: model(ids))[0]
        again = model(ids)
    assert last.shape == (batch, 1, cfg.vocab_size)
    assert (last[:, 0] - full[:, -1]).abs().max().item() <= 1e-12
    assert full_flops == forward_flops(cfg, t, 0, batch) and last_flops == forward_flops(cfg, t, 0, batch, "last")
    assert full_flops - last_flops == head_flops(cfg, t - 1, batch)
    assert torch.equal(again, full)  # the hook is gone when the block ends


@pytest.mark.parametrize("cached", [False, True])
def test_generation_with_the_head_on_the_last_row_counts_as_the_formula(cached):
    cfg = get_config("tiny", n_kv_heads=2)
    model = _model(cfg)
    ids = torch.randint(0, cfg.vocab_size, (1, 5), generator=torch.Generator().manual_seed(0))
    original, per_call = model.forward, []

    def counted(*args, **kwargs):
        out = []
        per_call.append(measure_flops(lambda: out.append(original(*args, **kwargs)))[0])
        return out[0]

    plain = generate(model, ids, 9, ConcatCache(cfg.n_layers)) if cached else generate_nocache(model, ids, 9)
    model.forward = counted
    with head_on_last_row(model):
        run = generate(model, ids, 9, ConcatCache(cfg.n_layers)) if cached else generate_nocache(model, ids, 9)
    assert per_call == generation_flops(cfg, 5, 9, cached, logits="last")
    assert torch.equal(run.ids, plain.ids)


@pytest.mark.parametrize("n", [1, 2, 5, 300])
def test_closed_form_sums_with_the_head_on_the_last_row(n):
    cfg = get_config("gpt2-124m")
    per_row = 2 * (linear_params(cfg) - cfg.d_model * cfg.vocab_size)
    assert linear_sum(cfg, n, False, "last") == sum(per_row * t + head_flops(cfg, 1) for t in range(1, n + 1))
    assert linear_sum(cfg, n, True, "last") == linear_sum(cfg, n, True)
    total = attention_sum(cfg, n, False) + linear_sum(cfg, n, False, "last")
    assert sum(generation_flops(cfg, 1, n, cached=False, logits="last")) == total
