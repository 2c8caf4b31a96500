"""llama.cpp beside the course's real model (`labcode.engines.llamacpp_compare`), without llama.cpp.

The measurement needs llama-cpp-python, which the course does not install; it is recorded in
qa/results/llamacpp_compare.json. Here: the pure parts (agreement measures, the positions of each
cache operation), the record built from a measurement, and the committed record checked by its rules.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from labcode.engines import llamacpp_compare as lc
from labcode.engines.cells import CellsCache
from labcode.kshift import context_shift
from labcode.results import schema_errors

ROOT = Path(__file__).resolve().parent.parent
COMMITTED = ROOT / "qa" / "results" / "llamacpp_compare.json"


def logits(t: int, v: int = 7, seed: int = 0) -> torch.Tensor:
    return torch.randn(t, v, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_the_module_imports_without_llama_cpp():
    import importlib.util

    assert importlib.util.find_spec("llama_cpp") is None  # not installed here (tests/test_repo.py insists)
    assert "llama_cpp" not in sys.modules and hasattr(lc, "main")  # and the module above imported all the same


def test_agreement_of_logits_with_themselves_and_a_constant_shift():
    ref = logits(5)
    targets = torch.tensor([0, 1, 2, 3, 4])
    same = lc.agreement(ref, ref.clone(), targets)
    assert same["positions"] == 5 and same["top1"] == 1.0 and same["kl_mean"] == 0 and same["kl_max"] == 0
    assert same["max_abs_diff"] == 0 and same["loss_course"] == same["loss_llamacpp"]
    assert math.isclose(same["loss_course"], F.cross_entropy(ref, targets).item())
    shifted = lc.agreement(ref, ref + 3.0)  # softmax ignores a constant: the same distributions
    assert shifted["top1"] == 1.0 and shifted["kl_max"] < 1e-12 and math.isclose(shifted["max_abs_diff"], 3.0)
    assert "loss_course" not in shifted


def test_agreement_counts_changed_argmaxes_and_measures_kl():
    ref = torch.tensor([[0.0, 2.0], [1.0, 0.0], [0.0, 0.0], [3.0, 0.0]])
    other = ref.clone()
    other[0] = torch.tensor([2.0, 0.0])  # the argmax of row 0 moves
    out = lc.agreement(ref, other)
    assert out["top1"] == 0.75 and out["max_abs_diff"] == 2.0
    p, q = torch.softmax(ref[0].double(), 0), torch.softmax(other[0].double(), 0)
    assert math.isclose(out["kl_max"], (p * (p / q).log()).sum().item())
    assert math.isclose(out["kl_mean"], out["kl_max"] / 4)
    kl = lc.kl_rows(logits(9, seed=1), logits(9, seed=2))
    assert kl.shape == (9,) and bool((kl > 0).all())  # different distributions: KL > 0


@pytest.mark.parametrize("other,targets,match", [
    (torch.zeros(4, 7), None, r"^other: expected logits of ref's shape \(5, 7\), got \(4, 7\)"),
    (torch.zeros(5, 7), torch.tensor([1, 2]), r"^targets: expected \[5\] token ids, one per row, got \(2,\)"),
])
def test_agreement_refuses_mismatched_inputs(other, targets, match):
    with pytest.raises(ValueError, match=match):
        lc.agreement(logits(5), other, targets)
    with pytest.raises(ValueError, match=r"^ref: expected logits \[T, V\] with T > 0"):
        lc.agreement(torch.zeros(7), torch.zeros(7))


def test_the_rollback_plan():
    plan = lc.rollback_plan(256, 32)
    assert plan["seq_rm"] == [224, 256] and plan["again"] == list(range(224, 256))
    assert plan["pos_max_after_rm"] == 223 and plan["fork_position"] == 256
    with pytest.raises(ValueError, match=r"^n_rollback: expected an int with 0 < n_rollback < n_tokens = 8, got 8"):
        lc.rollback_plan(8, 8)
    with pytest.raises(ValueError, match=r"^n_tokens: expected an int >= 2, got True"):
        lc.rollback_plan(True, 1)


@pytest.mark.parametrize("n_keep", [0, 4])
def test_the_shift_plan_is_what_the_cells_and_the_course_k_shift_do(n_keep):
    """The plan's seq_rm and seq_add, applied to the course's CellsCache, leave the positions it says; and
    `context_shift` keeps exactly the plan's `kept` positions (values carry their position here)."""
    length, n_discard = 12, 5
    plan = lc.shift_plan(length, n_discard, n_keep, 3)
    assert plan["seq_add"][1:] == [length, -n_discard] and plan["next"] == [7, 8, 9]
    cells = CellsCache(1, 16, n_seqs=1, default_seq=0)
    kv = torch.arange(length, dtype=torch.float64).view(1, 1, length, 1).expand(1, 1, length, 2)
    cells.feed(kv, kv)
    cells.seq_rm(0, *plan["seq_rm"])
    cells.seq_add(0, *plan["seq_add"])
    held = sorted(cells.pos[cells.pos >= 0].tolist())
    assert [held[0], held[-1]] == plan["pos_range_after"] and held == list(range(length - n_discard))
    shifted = context_shift([(kv.clone(), kv.clone())], n_discard, 10000.0, n_keep=n_keep)
    assert shifted[0][1][0, 0, :, 0].tolist() == plan["kept"]  # the values that stay, in order


def test_the_shift_plan_refuses_what_context_shift_refuses():
    with pytest.raises(ValueError, match=r"^n_discard: expected an int with 0 < n_discard < length 10 - n_keep 4"):
        lc.shift_plan(10, 6, 4, 1)
    with pytest.raises(ValueError, match=r"^n_keep: expected an int with 0 <= n_keep < length 10, got 10"):
        lc.shift_plan(10, 1, 10, 1)
    with pytest.raises(ValueError, match=r"^n_next: expected a positive int, got 0"):
        lc.shift_plan(10, 1, 0, 0)
    assert lc.ids_needed(lc.PARAMETERS) == lc.PARAMETERS["n_tokens"] + 1


def test_without_llama_cpp_the_command_says_so_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "path", list(sys.path))  # load_binding puts --site in front
    out = tmp_path / "r.json"
    assert lc.main(["--out", str(out), "--site", str(tmp_path)]) == 2
    assert "llama_cpp: expected llama-cpp-python installed, or a folder given with --site, got none" in \
        capsys.readouterr().out
    assert lc.main(["--out", str(out), "--site", str(tmp_path / "absent")]) == 2
    assert "site: expected a folder llama-cpp-python was installed into" in capsys.readouterr().out
    assert not out.exists()


def measured_from(values: dict) -> dict:
    """The measurement `record` was given, read back from a record's values."""
    shift = {k: {"positions": values["shift_positions"][k], "agreement": values["shift_agreement"][k],
                 "vs_recomputed": values["shift_vs_recomputed"][k],
                 "course_vs_recomputed": values["course_shift_vs_recomputed"][k]} for k in values["shift_positions"]}
    return {"version": values["version"], "tokens": values["tokens"], "logits": values["logits"],
            "seconds": values["prefill_seconds"], "system_info": values["system_info"],
            "settings": values["settings"],
            "no_flash": {"agreement": values["logits_flash_attention_off"],
                         "flash_attention_in_graph": values["flash_attention_in_graph"]["off"]},
            "rollback": {"positions": values["rollback_positions"],
                         "self_max_abs_diff": values["rollback_self_max_abs_diff"],
                         "batching": values["rollback_batching"],
                         "course_max_abs_diff": values["rollback_course_max_abs_diff"],
                         "agreement": values["rollback_agreement"],
                         "prefill_agreement": values["rollback_prefill_agreement"]},
            "fork": {"self_max_abs_diff": values["fork_self_max_abs_diff"],
                     "course_max_abs_diff": values["fork_course_max_abs_diff"], "agreement": values["fork_agreement"]},
            "shift": shift}


def fake_measurement(params: dict = lc.PARAMETERS, same_ids: bool = True) -> dict:
    """What `measure` returns, made of synthetic logits: close agreement, a shift unlike a fresh prefill."""
    n, r = params["n_tokens"], params["n_rollback"]
    ref = logits(n, seed=3)
    near = ref + 0.01 * logits(n, seed=4)
    far = logits(params["n_next"], seed=5)
    plan = lc.shift_plan(params["shift_len"], params["n_discard"], 0, params["n_next"])
    shift = {"positions": {"removed": True, "pos_range_after": plan["pos_range_after"]},
             "agreement": lc.agreement(ref[:16], near[:16]), "vs_recomputed": lc.agreement(far, near[:16]),
             "course_vs_recomputed": lc.agreement(far, ref[:16])}
    return {"version": lc.VERSION, "system_info": "CPU : AVX2 = 1", "seconds": {"course": 1.0, "llamacpp": 0.5},
            "settings": {"n_ctx": 1024, "flash_attention_in_graph": True},
            "tokens": {"compared": n + 1, "same_ids": same_ids, "text_tokens": 3000, "text_same_ids": same_ids,
                       "first_difference": None if same_ids else 7},
            "logits": lc.agreement(ref, near, torch.zeros(n, dtype=torch.long)),
            "no_flash": {"agreement": lc.agreement(ref, near), "flash_attention_in_graph": False},
            "rollback": {"positions": {"removed": True, "pos_max_after_rm": n - r - 1}, "self_max_abs_diff": 0.0,
                         "batching": lc.agreement(near[-r:], ref[-r:]), "course_max_abs_diff": 1e-6,
                         "agreement": lc.agreement(ref[-r:], near[-r:]),
                         "prefill_agreement": lc.agreement(ref[-r:], near[-r:])},
            "fork": {"self_max_abs_diff": 0.0, "course_max_abs_diff": 0.0,
                     "agreement": lc.agreement(ref[:2], near[:2])},
            "shift": {f"n_keep{k}": shift | {"positions": {"removed": True, "pos_range_after": [0, 47]}}
                      for k in params["keeps"]}}


def test_a_measurement_becomes_a_valid_record(tmp_path):
    qa = lc.record(fake_measurement())
    doc = qa.doc
    assert doc["name"] == "llamacpp_compare" and doc["machine_dependent"] and schema_errors(doc) == []
    assert doc["passed"], [c["name"] for c in doc["checks"] if not c["passed"]]
    assert all(c["name"].startswith("llamacpp/compare/") for c in doc["checks"])  # the report's chapter 9.8
    assert doc["rules"]["prefill_seconds"]["compare"] == "recorded" and doc["rules"]["tokens"]["compare"] == "exact"
    qa.write(tmp_path / "llamacpp_compare.json")
    assert measured_from(json.loads((tmp_path / "llamacpp_compare.json").read_text())["values"]) == \
        json.loads(json.dumps(fake_measurement()))  # the record holds the whole measurement


def test_a_tokenizer_that_disagrees_fails_the_record(tmp_path):
    qa = lc.record(fake_measurement(same_ids=False))
    failed = [c["name"] for c in qa.doc["checks"] if not c["passed"]]
    assert failed == ["llamacpp/compare/same_ids"]
    with pytest.raises(AssertionError, match="llamacpp/compare/same_ids"):
        qa.write(tmp_path / "r.json")


# -- the committed record --------------------------------------------------------------------------

def committed() -> dict:
    return json.loads(COMMITTED.read_text())


def test_the_committed_record_is_what_its_measurement_makes_under_todays_rules():
    """Rebuilt from its own values by today's `record`, the committed file has the same checks (claims,
    bounds, verdicts) and rules: the comparison is made again without llama.cpp."""
    doc = committed()
    assert schema_errors(doc) == [] and doc["machine_dependent"] and doc["passed"]
    again = lc.record(measured_from(doc["values"]), doc["parameters"]).doc
    assert again["rules"] == doc["rules"] and again["values"] == doc["values"]
    strip = lambda checks: [{k: c[k] for k in ("name", "claim", "value", "tolerance", "comparison", "passed")}
                            for c in checks]
    assert strip(again["checks"]) == strip(doc["checks"])
    assert doc["parameters"] == lc.PARAMETERS


def test_the_committed_record_supports_what_chapter_9_says():
    values = committed()["values"]
    assert values["tokens"]["same_ids"] and values["tokens"]["compared"] == lc.PARAMETERS["n_tokens"] + 1
    assert values["logits"]["positions"] == lc.PARAMETERS["n_tokens"]
    assert values["logits"]["top1"] >= lc.TOP1_MIN and values["logits"]["kl_mean"] <= lc.KL_MEAN_MAX
    assert values["flash_attention_in_graph"] == {"default": True, "off": False}
    # llama.cpp reproduces itself after seq_rm and seq_cp (the same batching) to rounding, while a
    # different batching moves its logits by far more than rounding: the chapter says both.
    assert values["rollback_self_max_abs_diff"] <= lc.SELF_TOL and values["fork_self_max_abs_diff"] <= lc.SELF_TOL
    assert values["rollback_batching"]["max_abs_diff"] > 100 * lc.SELF_TOL
    for key in ("n_keep0", "n_keep4"):
        shift, fresh = values["shift_agreement"][key], values["shift_vs_recomputed"][key]
        assert shift["kl_mean"] * lc.CONTRAST <= fresh["kl_mean"]
