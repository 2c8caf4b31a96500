"""Every QA result file follows `qa/results.schema.json`, and the writer keeps its promises.

The committed files are validated here; the files that `tests/test_qa.py` regenerates are
validated there, with the same `labcode.results.schema_errors`.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch

from labcode.results import (
    QAResult,
    close,
    exact,
    float_rule,
    recorded,
    rounding_rule,
    schema_errors,
    write_json_atomic,
)

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = json.loads((ROOT / "qa" / "results.schema.json").read_text())
COMMITTED = sorted((ROOT / "qa" / "results").glob("*.json"))


def test_schema_is_a_valid_json_schema():
    jsonschema.Draft202012Validator.check_schema(SCHEMA)


def test_there_are_committed_results():
    assert COMMITTED, "qa/results/ holds no result files"


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: p.name)
def test_committed_result_follows_the_schema(path):
    doc = json.loads(path.read_text())
    assert schema_errors(doc) == []
    assert doc["passed"] == all(c["passed"] for c in doc["checks"]), "overall 'passed' must summarise the checks"


def _fresh(tmp_path: Path) -> dict:
    qa = QAResult("demo", {"dtype": "float64", "n": 3})
    qa.value("diffs", [1e-16, 2.5], close(abs_tol=1e-12))
    qa.value("count", 3, exact())
    qa.value("wall_s", 0.25, recorded("a timing"))
    qa.check("demo/eq", "equal to rounding", 4e-16, 1e-12)
    qa.check("demo/bool", "a yes/no claim", True, True, "==")
    return json.loads(qa.write(tmp_path / "demo.json").read_text())


def test_what_the_writer_writes_follows_the_schema(tmp_path):
    assert schema_errors(_fresh(tmp_path)) == []


@pytest.mark.parametrize("breakage,where", [
    (lambda d: d.pop("passed"), "'passed' is a required property"),
    (lambda d: d["checks"][0].update(comparison="~"), "checks/0/comparison"),
    (lambda d: d["checks"][1].pop("claim"), "'claim' is a required property"),
    (lambda d: d.update(passed="yes"), "passed"),
    (lambda d: d.update(extra=1), "Additional properties"),
    (lambda d: d.update(schema_version=1), "schema_version"),
    (lambda d: d.pop("rules"), "'rules' is a required property"),
    (lambda d: d["rules"].pop("count"), "one rule per value"),
    (lambda d: d["rules"].update(count={"compare": "roughly"}), "rules/count"),
    (lambda d: d["rules"].update(count={"compare": "close", "abs": -1, "rel": 0}), "rules/count"),
    (lambda d: d["environment"].pop("cpu_capability"), "'cpu_capability' is a required property"),
    (lambda d: d.update(created="yesterday"), "created"),
    (lambda d: d["environment"].update(torch_threads=0), "environment/torch_threads"),
])
def test_the_schema_rejects_broken_documents(tmp_path, breakage, where):
    doc = _fresh(tmp_path)
    breakage(doc)
    errors = schema_errors(doc)
    assert any(where in e for e in errors), errors


def test_a_failed_check_is_written_then_raised(tmp_path):
    qa = QAResult("demo", {})
    qa.check("demo/ok", "holds", 1, 1, "==")
    qa.check("demo/bad", "does not hold", 0.5, 1e-12)
    with pytest.raises(AssertionError, match="demo/bad"):
        qa.write(tmp_path / "r.json")
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["passed"] is False and [c["passed"] for c in doc["checks"]] == [True, False]
    assert schema_errors(doc) == []


def test_an_interrupted_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "r.json"
    write_json_atomic(path, {"old": True})
    with pytest.raises(TypeError):
        write_json_atomic(path, {"new": object()})  # fails halfway through json.dump
    assert json.loads(path.read_text()) == {"old": True}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_values_need_a_rule_and_rules_are_well_formed():
    qa = QAResult("demo", {})
    with pytest.raises(TypeError):
        qa.value("x", 1.0)  # no rule: a value must say how it is compared
    with pytest.raises(ValueError, match="rule"):
        qa.value("x", 1.0, {"compare": "roughly"})
    with pytest.raises(ValueError, match="abs_tol, rel_tol"):
        close()
    with pytest.raises(ValueError, match="why"):
        recorded("")
    with pytest.raises(ValueError, match="dtype"):
        float_rule(torch.int64)
    assert float_rule("float64") == close(rel_tol=1e-9) and float_rule(torch.float32)["rel"] > 1e-6
    assert rounding_rule(1e-12) == close(abs_tol=1e-12)


def test_the_environment_names_the_cpu_and_its_kernels():
    env = QAResult("demo", {}).doc["environment"]
    assert env["cpu"] and env["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
