"""QA results that CI regenerates: every committed `qa/results/*.json` is reproduced from scratch.

Each result file names the QA notebook that wrote it (`name`: `qa/<name>.ipynb`) and records every
parameter it ran with except `output_path`. For each committed file this test runs that notebook
with papermill (kernel python3, working directory the repository root, executed copy under
`qa/_runs/test/`), with the recorded parameters and `output_path` pointing into a temporary folder,
so the committed results are never overwritten. A QA run that fails a check exits non-zero and
fails the test. The regenerated file must then match the committed one:

- the same checks in the same order, with the same claims, comparisons and tolerances, and
  identical verdicts (a check is compared by its verdict, not by its digits);
- the same value keys with the same rules, and every value equal under the rule the QA notebook
  declared when it wrote it (`labcode.results`: `exact`, `close` with its own absolute and relative
  tolerance, or `recorded`, never compared); inside a `close` value, integers, booleans and strings
  are still compared exactly.

A long record (`<name>_long.json`: a QA notebook run on long texts by `scripts/regenerate_results.sh
--long`, minutes of every core) is regenerated and compared the same way only when asked
(`KVCV_LONG_RECORDS=1`); otherwise its schema, parameters and committed checks are checked.

Result files that no QA notebook writes are recorded benchmarks (`machine_dependent: true`, for
example `bench.json` from `python -m labcode.bench --full`): they are validated against the schema
and their committed checks must pass, but they are not regenerated here, because their timings
depend on the machine and take minutes to measure (`tests/test_bench.py` runs the harness small).

`scripts/regenerate_results.sh` writes the committed files; it explains the whole arrangement.
"""

from __future__ import annotations

import ast
import json
import math
import os
import re
from pathlib import Path

import pytest

from labcode.results import close, exact, recorded, resolve_output, schema_errors

ROOT = Path(__file__).resolve().parent.parent
QA = ROOT / "qa"
QA_NOTEBOOKS = sorted(p for p in QA.glob("*.ipynb") if p.stem != "verdicts")
ALL_COMMITTED = sorted((QA / "results").glob("*.json"))
COMMITTED = [p for p in ALL_COMMITTED if (QA / f"{json.loads(p.read_text())['name']}.ipynb").exists()]
RECORDED = [p for p in ALL_COMMITTED if p not in COMMITTED]  # benchmarks: recorded, never regenerated here
# Long records: a QA notebook's run on long texts (`<name>_long.json`), minutes of every core. The test
# command checks them like the benchmarks (schema, committed checks passed, the notebook's parameters);
# the opt-in step regenerates them and compares them by their rules: KVCV_LONG_RECORDS=1.
LONG = [p for p in COMMITTED if p.stem.endswith("_long")]
REGENERATED = COMMITTED if os.environ.get("KVCV_LONG_RECORDS") == "1" else [p for p in COMMITTED if p not in LONG]


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def parameters_cell(notebook: Path) -> dict:
    """The first code cell: its tags, and the names it assigns mapped to their default expressions."""
    nb = load(notebook)
    cell = next(c for c in nb["cells"] if c["cell_type"] == "code")
    tree = ast.parse("".join(cell["source"]))
    names = {t.id: node.value for node in tree.body if isinstance(node, ast.Assign)
             for t in node.targets if isinstance(t, ast.Name)}
    return {"tags": cell.get("metadata", {}).get("tags", []), "names": names}


# -- comparing a regenerated document with the committed one -------------------------------------

def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _non_finite(x) -> bool:
    """A NaN or an infinity, as a float or in the string form `labcode.results` writes it in."""
    if isinstance(x, float):
        return not math.isfinite(x)
    return isinstance(x, str) and x.strip().lower() in ("nan", "-nan", "inf", "-inf", "infinity", "-infinity")


def _same_infinity(new, old) -> bool:
    """Both the same infinity (a committed infinite critical batch regenerated as one); NaN never is."""
    as_float = lambda x: float(x) if isinstance(x, (float, str)) else math.nan  # noqa: E731
    return _non_finite(new) and _non_finite(old) and math.isinf(as_float(new)) and as_float(new) == as_float(old)


def _leaves(x, path: str):
    if isinstance(x, dict):
        return [leaf for k, v in x.items() for leaf in _leaves(v, f"{path}.{k}")]
    if isinstance(x, list):
        return [leaf for i, v in enumerate(x) for leaf in _leaves(v, f"{path}[{i}]")]
    return [(path, x)]


def non_finite_differences(new, old, path: str) -> list[str]:
    """Every NaN or infinity in `new` that the committed value does not hold at the same place: a
    measurement that produced nothing, whatever the rule (a recorded timing included)."""
    committed = dict(_leaves(old, path))
    return [f"{p}: {x!r} is not a finite number (committed {committed.get(p)!r})" for p, x in _leaves(new, path)
            if _non_finite(x) and not _same_infinity(x, committed.get(p))]


def differences(new, old, path: str, rule: dict) -> list[str]:
    """Where `new` and `old` (JSON values) differ under `rule`; [] when they agree. A NaN or an infinity
    in `new` differs under every rule, unless the committed value is the same infinity."""
    bad = non_finite_differences(new, old, path)
    if bad or rule["compare"] == "recorded":
        return bad
    if isinstance(old, dict) and isinstance(new, dict):
        if set(new) != set(old):
            return [f"{path}: keys {sorted(set(new) ^ set(old))} added or missing"]
        return [d for k in old for d in differences(new[k], old[k], f"{path}.{k}", rule)]
    if isinstance(old, list) and isinstance(new, list):
        if len(new) != len(old):
            return [f"{path}: length {len(new)} != committed {len(old)}"]
        return [d for i, (a, b) in enumerate(zip(new, old, strict=True))
                for d in differences(a, b, f"{path}[{i}]", rule)]
    floats = _number(old) and _number(new) and (isinstance(old, float) or isinstance(new, float))
    if floats and rule["compare"] == "close":
        if math.isclose(new, old, rel_tol=rule["rel"], abs_tol=rule["abs"]):
            return []
        return [f"{path}: {new!r} differs from committed {old!r} (rel {rule['rel']:g}, abs {rule['abs']:g})"]
    if new == old and type(new) is type(old):
        return []
    return [f"{path}: {new!r} != committed {old!r} (compared exactly)"]


def compare(new: dict, old: dict) -> list[str]:
    """Every difference between a regenerated result and the committed one that this test rejects."""
    found = []
    for key in ("schema_version", "name", "parameters"):
        if new[key] != old[key]:
            found.append(f"{key}: {new[key]!r} != committed {old[key]!r}")
    names_new, names_old = [c["name"] for c in new["checks"]], [c["name"] for c in old["checks"]]
    if names_new != names_old:
        return found + [f"checks: {names_new} != committed {names_old}"]
    for a, b in zip(new["checks"], old["checks"], strict=True):
        for key in ("claim", "comparison", "tolerance", "passed"):
            if a[key] != b[key]:
                found.append(f"check {b['name']}: {key} {a[key]!r} != committed {b[key]!r}")
    if set(new["values"]) != set(old["values"]):
        return found + [f"values: keys {sorted(set(new['values']) ^ set(old['values']))} added or missing"]
    for key, old_value in old["values"].items():
        rule = old["rules"][key]
        if new["rules"][key] != rule:
            found.append(f"values.{key}: rule {new['rules'][key]} != committed {rule}")
            continue
        found += differences(new["values"][key], old_value, f"values.{key}", rule)
    if new["passed"] != old["passed"]:
        found.append(f"passed: {new['passed']} != committed {old['passed']}")
    return found


# -- the committed files and the notebooks that write them ----------------------------------------

def test_every_qa_notebook_has_a_committed_result_and_back():
    assert QA_NOTEBOOKS, "no QA notebooks in qa/"
    written = {load(p)["name"] for p in COMMITTED}
    assert {p.stem for p in QA_NOTEBOOKS} - written == set(), "QA notebooks without a committed result"
    not_benchmarks = [p.name for p in RECORDED if not load(p)["machine_dependent"]]
    assert not not_benchmarks, f"results written by no QA notebook must be recorded benchmarks: {not_benchmarks}"


def test_long_records_are_named_for_their_notebook_and_regenerated_when_asked():
    script = (ROOT / "scripts" / "regenerate_results.sh").read_text()
    for path in LONG:
        assert path.stem == load(path)["name"] + "_long", path.name
        assert (QA / "results" / f"{load(path)['name']}.json").exists(), f"{path.name}: its short run is missing"
    assert "KVCV_LONG_RECORDS=1" in script and "--long" in script


def test_regenerate_script_writes_every_committed_result():
    script = (ROOT / "scripts" / "regenerate_results.sh").read_text()
    lines = re.findall(r"^run_qa (qa/\S+\.ipynb) (\S+\.json)", script, flags=re.M)
    assert sorted(f for _, f in lines) == sorted(p.name for p in COMMITTED), "run_qa lines and qa/results/ disagree"
    for notebook, result in lines:
        assert notebook == f"qa/{load(QA / 'results' / result)['name']}.ipynb", (notebook, result)
    for path in RECORDED:
        assert f"qa/results/{path.name}" in script, f"the script does not say how {path.name} is regenerated"


@pytest.mark.parametrize("notebook", QA_NOTEBOOKS, ids=lambda p: p.stem)
def test_parameters_cell_matches_what_results_record(notebook):
    cell = parameters_cell(notebook)
    assert "parameters" in cell["tags"], f"{notebook.name}: the first code cell must be tagged 'parameters'"
    default = cell["names"].get("output_path")
    assert default is not None and ast.literal_eval(default) == "", f"{notebook.name}: output_path must default to ''"
    for path in COMMITTED:
        doc = load(path)
        if doc["name"] == notebook.stem:
            assert set(doc["parameters"]) == set(cell["names"]) - {"output_path"}, (
                f"{path.name} records parameters {sorted(doc['parameters'])}, the notebook has {sorted(cell['names'])}")


def test_default_output_never_touches_committed_results():
    default = resolve_output("", "probes").relative_to(ROOT)
    assert default.parts[:2] == ("qa", "_runs"), default
    assert "qa/_runs/" in (ROOT / ".gitignore").read_text().split(), "qa/_runs/ must be git-ignored"


@pytest.mark.parametrize("path", ALL_COMMITTED, ids=lambda p: p.name)
def test_committed_result_passed(path):
    doc = load(path)
    failed = [c["name"] for c in doc["checks"] if not c["passed"]]
    assert doc["checks"] and not failed and doc["passed"], f"{path.name}: failed checks {failed}"


# -- regeneration ----------------------------------------------------------------------------------

def regenerated_by_nbval(path: Path, old: dict) -> Path | None:
    """The result file that nbval's execution of the QA notebook wrote in this session (notebook defaults,
    default output path), if those defaults are the committed file's parameters; else None."""
    from conftest import SESSION_START, executed_whole

    out = resolve_output("", path.stem)
    notebook = QA / f"{old['name']}.ipynb"
    if not (executed_whole(notebook) and out.exists() and out.stat().st_mtime >= SESSION_START):
        return None
    return out if load(out)["parameters"] == old["parameters"] else None


@pytest.mark.parametrize("path", REGENERATED, ids=lambda p: p.name)
def test_regenerated_result_matches_committed(path, tmp_path):
    """Every committed result, regenerated in this session: by nbval's run of its notebook when that ran
    with the committed parameters (every cell passed, so every check did), else by papermill here."""
    import papermill

    old = load(path)
    notebook = QA / f"{old['name']}.ipynb"
    fresh = regenerated_by_nbval(path, old)
    if fresh is not None:
        new = load(fresh)
        assert schema_errors(new) == [], f"regenerated {path.name} breaks the schema"
        found = compare(new, old)
        assert not found, f"regenerated {path.name} differs from the committed file:\n" + "\n".join(found)
        return
    out = tmp_path / path.name
    executed = QA / "_runs" / "test" / f"{path.stem}.ipynb"
    executed.parent.mkdir(parents=True, exist_ok=True)
    try:
        papermill.execute_notebook(str(notebook), str(executed), parameters={**old["parameters"],
                                   "output_path": str(out)}, kernel_name="python3", cwd=str(ROOT),
                                   progress_bar=False, log_output=False)
    except papermill.PapermillExecutionError as e:
        failed = [c["name"] for c in load(out)["checks"] if not c["passed"]] if out.exists() else "no result"
        pytest.fail(f"QA run {notebook.name} for {path.name} failed: {e.ename}: {e.evalue}\nfailed checks: {failed}")
    new = load(out)
    assert schema_errors(new) == [], f"regenerated {path.name} breaks the schema"
    found = compare(new, old)
    assert not found, f"regenerated {path.name} differs from the committed file:\n" + "\n".join(found)


# -- the comparison itself can fail ----------------------------------------------------------------

def _doc(value=4.4e-16, passed=True, big=2.9, tokens=17) -> dict:
    return {"schema_version": 2, "name": "x", "parameters": {"dtype": "float64"}, "passed": passed,
            "values": {"diff": value, "counter": [big, 0.5], "window": tokens, "wall_seconds": 3.0,
                       "mixed": {"rows": 6, "err": 0.0925, "reason": "context_length"}},
            "rules": {"diff": close(abs_tol=1e-12), "counter": close(rel_tol=1e-9), "window": exact(),
                      "wall_seconds": recorded("a timing"), "mixed": close(rel_tol=1e-3)},
            "checks": [{"name": "eq", "claim": "equal", "value": value, "tolerance": 1e-12, "comparison": "<=",
                        "passed": passed},
                       {"name": "far", "claim": "different", "value": big, "tolerance": 1e-3, "comparison": ">",
                        "passed": True}]}


def test_comparison_accepts_rounding_timings_and_declared_tolerances():
    new = _doc(value=6.7e-16)
    new["checks"][1]["value"] = 3.1  # a check is compared by its verdict, not by its digits
    new["values"]["wall_seconds"] = 99.0
    new["values"]["counter"][1] = 0.5 * (1 + 1e-12)
    new["values"]["mixed"]["err"] = 0.09251  # within rel 1e-3
    assert compare(new, _doc()) == []


@pytest.mark.parametrize("change,expected", [
    (lambda d: d["checks"][0].update(passed=False), "passed"),
    (lambda d: d["checks"][0].update(tolerance=1e-6), "tolerance"),
    (lambda d: d["checks"][1].update(claim="similar"), "claim"),
    (lambda d: d["checks"].pop(), "checks"),
    (lambda d: d["values"].update(window=16), "values.window"),
    (lambda d: d["values"].update(window=17.0), "values.window"),
    (lambda d: d["values"]["counter"].__setitem__(0, 2.91), "values.counter[0]"),
    (lambda d: d["values"].update(diff=1e-10), "values.diff"),
    (lambda d: d["values"]["mixed"].update(rows=7), "values.mixed.rows"),
    (lambda d: d["values"]["mixed"].update(err=0.0935), "values.mixed.err"),
    (lambda d: d["values"]["mixed"].update(reason="max_new_tokens"), "values.mixed.reason"),
    (lambda d: d["values"].pop("window"), "values: keys"),
    (lambda d: d["rules"].update(diff=close(abs_tol=1e-6)), "rule"),
    (lambda d: d["parameters"].update(dtype="float32"), "parameters"),
])
def test_comparison_rejects_real_differences(change, expected):
    new = _doc()
    change(new)
    found = compare(new, _doc())
    assert any(expected in f for f in found), found


# -- a regenerated NaN or infinity never matches --------------------------------------------------

RULES = {"exact": exact(), "close-abs": close(abs_tol=1e-12), "close-rel": close(rel_tol=1e-9),
         "float32": close(rel_tol=1e-3), "rounding": close(abs_tol=1e-3), "recorded": recorded("a timing")}


@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), "nan", "inf", "-inf"], ids=repr)
@pytest.mark.parametrize("where", ["scalar", "list", "dict"])
def test_comparison_rejects_a_non_finite_value_under_every_rule(rule, bad, where):
    """A broken cache's NaN logits regenerate a NaN difference: the comparison must report it, as a
    float or in the string form results are written in, alone or inside a list or a dict."""
    committed = {"scalar": 4.4e-16, "list": [4.4e-16, 0.5], "dict": {"rows": 6, "err": 4.4e-16}}[where]
    regenerated = {"scalar": bad, "list": [bad, 0.5], "dict": {"rows": 6, "err": bad}}[where]
    old, new = _doc(), _doc()
    for doc, value in ((old, committed), (new, regenerated)):
        doc["values"]["probe"] = value
        doc["rules"]["probe"] = RULES[rule]
    assert compare(_doc(), _doc()) == []
    found = compare(new, old)
    assert any("values.probe" in f and "not a finite number" in f for f in found), found


@pytest.mark.parametrize("comparison", ["<=", "<", ">=", ">", "=="])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=repr)
def test_comparison_rejects_a_check_that_measured_nothing(comparison, bad):
    """The check itself fails in the library (tests/test_nonfinite_verdicts.py), so the regenerated
    verdict differs from the committed one under every comparison."""
    from labcode.results import QAResult

    qa = QAResult("x", {})
    qa.check("eq", "equal", bad, 1e-12 if comparison in ("<=", "<") else 1.0, comparison)
    new, old = _doc(), _doc()
    for doc in (new, old):
        doc["checks"][0].update(comparison=comparison, tolerance=qa.doc["checks"][0]["tolerance"])
    new["checks"][0].update(value=qa.doc["checks"][0]["value"], passed=qa.doc["checks"][0]["passed"])
    new["passed"] = qa.doc["passed"]
    found = compare(new, old)
    assert any("check eq: passed False" in f for f in found) and any(f.startswith("passed:") for f in found), found


def test_a_committed_infinity_regenerated_as_the_same_infinity_matches():
    old, new = _doc(), _doc()
    for doc in (old, new):
        doc["values"]["critical_batch"] = "inf"
        doc["rules"]["critical_batch"] = exact()
    assert compare(new, old) == []
    new["values"]["critical_batch"] = "-inf"
    assert compare(new, old)
