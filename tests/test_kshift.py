"""The rotary key shift of chapter 6 (llama.cpp's K-shift), tested directly: moving a cached key by delta
positions is the same as rotating the unrotated key at its new position, in either direction."""

from __future__ import annotations

import pytest
import torch
from helpers import TOL64, build
from hypothesis import given, settings
from hypothesis import strategies as st

from labcode import GPTConfig
from labcode.kshift import context_shift, shift_keys
from labcode.model import rotate

pytestmark = pytest.mark.usefixtures("one_thread")  # defined in conftest.py


def _keys(seed: int, s: int = 7, d: int = 8) -> torch.Tensor:
    return torch.randn(2, 3, s, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(start=st.integers(0, 500), delta=st.integers(-300, 300), base=st.sampled_from([10.0, 10000.0]),
       seed=st.integers(0, 2**16))
def test_shifting_a_rotated_key_equals_rotating_it_at_the_new_position(start, delta, base, seed):
    raw = _keys(seed)  # keys before the rotation, [B, Hkv, S, D]
    positions = torch.arange(start, start + raw.shape[2])
    cached = rotate(raw, positions, base)  # what a rotary cache holds
    moved = shift_keys(cached, delta, base)
    assert (moved - rotate(raw, positions + delta, base)).abs().max().item() <= TOL64
    assert (shift_keys(moved, -delta, base) - cached).abs().max().item() <= TOL64  # and back


def test_the_shift_has_the_right_sign_and_is_not_the_identity():
    raw = _keys(0)
    positions = torch.arange(raw.shape[2])
    cached = rotate(raw, positions, 10000.0)
    later = shift_keys(cached, 3, 10000.0)
    assert (later - rotate(raw, positions + 3, 10000.0)).abs().max().item() <= TOL64
    assert (later - rotate(raw, positions - 3, 10000.0)).abs().max().item() > 1e-3  # a sign error shows
    assert (later - cached).abs().max().item() > 1e-3
    assert torch.equal(shift_keys(cached, 0, 10000.0), cached)


def test_context_shift_drops_the_oldest_and_renumbers_the_first_layer_exactly():
    cfg = GPTConfig(vocab_size=13, context_length=32, n_layers=2, n_heads=4, n_kv_heads=2, d_model=16, rotary=True)
    model = build(cfg, seed=2, scale=0.5)
    ids = torch.randint(0, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        _, pairs = model(ids, None, return_cache=True)
        _, fresh = model(ids[:, 5:], None, return_cache=True)  # the kept tokens recomputed from position 0
    kept = [tuple(t.clone() for t in p) for p in pairs]
    shifted = context_shift(pairs, 5, cfg.rope_base)
    assert all(torch.equal(a, b) for p, q in zip(pairs, kept, strict=True) for a, b in zip(p, q, strict=True))
    assert (shifted[0][0] - fresh[0][0]).abs().max().item() <= TOL64  # layer 0's keys: exactly the recomputed ones
    assert torch.equal(shifted[0][1], pairs[0][1][:, :, 5:])  # values carry no position
    assert (shifted[1][0] - fresh[1][0]).abs().max().item() > 1e-6  # deeper layers remember the dropped tokens


KEYS = torch.zeros(1, 1, 2, 4)


@pytest.mark.parametrize("call, match", [
    (lambda: shift_keys(torch.zeros(1, 1, 2, 3), 1, 10.0), r"k: expected a \[B, Hkv, S, D\] tensor with even D"),
    (lambda: shift_keys(KEYS, True, 10.0), r"delta: expected an integer number of positions, got True"),
    (lambda: shift_keys(KEYS, 1.5, 10.0), r"delta: expected an integer number of positions, got 1.5"),
    (lambda: context_shift([(torch.zeros(1, 1, 4, 4),) * 2], 4, 10.0),
     r"n_drop: expected an integer with 0 <= n_drop < cached length 4, got 4"),
])
def test_bad_arguments_are_refused(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_context_shift_with_kept_first_positions_is_not_the_drop_in_place():
    """llama.cpp keeps n_keep positions in front: the shift then moves later queries closer to them, so
    it equals the drop in place only when nothing is kept (with rotary positions only distances count)."""
    from labcode.kshift import DropInPlace

    cfg = GPTConfig(vocab_size=13, context_length=32, n_layers=2, n_heads=4, n_kv_heads=2, d_model=16, rotary=True)
    model = build(cfg, seed=4, scale=0.5)
    ids = torch.randint(0, cfg.vocab_size, (1, 14), generator=torch.Generator().manual_seed(5))
    nxt = ids[:, -1:]
    gaps = {}
    with torch.no_grad():
        for n_keep in (0, 3):
            _, pairs = model(ids, None, return_cache=True)
            shifted = context_shift(pairs, 4, cfg.rope_base, n_keep=n_keep)
            assert shifted[0][0].shape[2] == 14 - 4
            assert torch.equal(shifted[0][0][:, :, :n_keep], pairs[0][0][:, :, :n_keep])  # kept keys untouched
            in_place = DropInPlace(cfg.n_layers, 4, n_keep)
            model(ids, in_place)
            in_place.hide = True
            gaps[n_keep] = (model(nxt, shifted, return_cache=True)[0] - model(nxt, in_place)).abs().max().item()
    assert gaps[0] <= TOL64 < 1e-6 < gaps[3], gaps
    with pytest.raises(ValueError, match=r"n_drop: expected an integer with 0 <= n_drop < cached length 14 - n_keep 3"):
        context_shift(pairs, 11, cfg.rope_base, n_keep=3)
