"""A verdict never passes on nothing: a check whose measured value is NaN or infinite fails, under
every comparison, in the library's own check (`labcode.results.QAResult.check`) and in the claims a
page prints (`labcode.display.claim`, `within`). A broken cache that turns the logits into NaN must
fail its equivalence check, not pass it because NaN compares false to everything else.

The regeneration comparison (tests/test_qa.py, `compare`) is held to the same in that file.
"""

from __future__ import annotations

import math

import pytest
import torch

from labcode import GPT, GPTConfig
from labcode.caches import ConcatCache
from labcode.display import claim, max_diff, within
from labcode.results import COMPARISONS, QAResult, finite

NOT_A_NUMBER = [float("nan"), float("inf"), float("-inf")]
# For each comparison a tolerance under which an ordinary finite value passes: the non-finite
# value must fail where a real measurement would have passed.
PASSING = {"<=": (1e-13, 1e-12), "<": (1e-13, 1e-12), ">=": (3.0, 1.0), ">": (3.0, 1.0), "==": (2.0, 2.0)}


def test_every_comparison_is_covered():
    assert set(PASSING) == set(COMPARISONS)


@pytest.mark.parametrize("comparison", sorted(COMPARISONS))
@pytest.mark.parametrize("bad", NOT_A_NUMBER, ids=str)
@pytest.mark.parametrize("form", ["float", "tensor", "list"])
def test_a_check_fails_on_a_non_finite_value(comparison, bad, form, tmp_path):
    good, tolerance = PASSING[comparison]
    qa = QAResult("probe", {})
    assert qa.check("real", "a real measurement", good, tolerance, comparison)  # the check can pass
    value = {"float": bad, "tensor": torch.tensor(bad, dtype=torch.float64), "list": [good, bad]}[form]
    assert not qa.check("broken", "a broken measurement", value, tolerance, comparison)
    assert qa.doc["passed"] is False and qa.doc["checks"][-1]["passed"] is False
    with pytest.raises(AssertionError, match="broken"):
        qa.write(tmp_path / "probe.json")


@pytest.mark.parametrize("bad", NOT_A_NUMBER, ids=str)
def test_a_printed_claim_refuses_a_non_finite_value(bad):
    assert claim(1e-15, 1e-12) == "≤ 1e-12 (rounding)"
    with pytest.raises(AssertionError):
        claim(bad, 1e-12)
    assert within(bad, 1e-12) == str(bad)  # printed as what it is, never as "≤1e-12"


def test_finite_looks_inside_lists_dicts_and_tensors():
    assert finite(1.0) and finite(3) and finite("inf") and finite(True) and finite(None)
    assert not finite([1.0, [2.0, math.nan]]) and not finite({"a": {"b": -math.inf}})
    assert not finite(torch.tensor([0.0, math.inf])) and finite(torch.tensor([1, 2]))


class NaNCache(ConcatCache):
    """A broken cache: every key it returns is NaN."""

    def _append(self, layer, k, v):
        k_all, v_all = super()._append(layer, k, v)
        return torch.full_like(k_all, math.nan), v_all


@pytest.mark.parametrize("comparison", ["<=", "<"])
def test_a_cache_that_returns_nan_fails_its_equivalence_check(comparison, no_grad):
    cfg = GPTConfig(vocab_size=11, context_length=8, n_layers=2, n_heads=2, d_model=8)
    torch.manual_seed(0)
    model = GPT(cfg).double().eval()
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    full = model(ids)
    for kind, expect_pass in ((ConcatCache, True), (NaNCache, False)):
        cache = kind(cfg.n_layers)
        cached = torch.cat([model(ids[:, :3], cache), model(ids[:, 3:], cache)], dim=1)
        diff = max_diff(cached, full)
        qa = QAResult("probe", {})
        assert qa.check("cached = full", "the cache changes nothing", diff, 1e-12, comparison) is expect_pass
        if not expect_pass:
            assert math.isnan(diff)
            with pytest.raises(AssertionError):
                claim(diff, 1e-12)
