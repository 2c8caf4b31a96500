"""QA result files: one JSON document per QA notebook, written atomically.

Introduced in the verification report. A document holds the schema version, the
parameters, the environment, measured values, each with the rule a regenerated value is
compared by, and a list of checks (claim, value, tolerance, comparison, passed), with an
overall `passed`. `qa/results.schema.json` describes the format.

The rules (`exact`, `close`, `recorded`) are chosen where a value is written, from what it
is: counts, ids and verdicts are exact; a float is only as stable as the dtype and the
computation that made it (`float_rule`); a rounding-level difference is the same claim on
every machine as long as it stays below its bound (`rounding_rule`); timings and machine
facts are recorded, never compared.
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import tempfile
from datetime import datetime, timezone
from pathlib import Path

import torch

SCHEMA_VERSION = 2
COMPARISONS = {
    "<=": lambda value, tol: value <= tol,
    ">=": lambda value, tol: value >= tol,
    "==": lambda value, tol: value == tol,
    "<": lambda value, tol: value < tol,
    ">": lambda value, tol: value > tol,
}


# -- comparison rules: how a regenerated value is compared with the committed one ----------------

def exact() -> dict:
    """Counts, ids, shapes, flags, strings, and floats that exact arithmetic produced: equal, digit for digit."""
    return {"compare": "exact"}


def close(*, abs_tol: float = 0.0, rel_tol: float = 0.0) -> dict:
    """Floats equal within `abs_tol` or `rel_tol` (as `math.isclose`); integers, flags and strings inside stay exact."""
    if not (abs_tol >= 0 and rel_tol >= 0 and abs_tol + rel_tol > 0):
        raise ValueError(f"abs_tol, rel_tol: expected >= 0 and not both 0, got {abs_tol}, {rel_tol}")
    return {"compare": "close", "abs": abs_tol, "rel": rel_tol}


def recorded(why: str) -> dict:
    """Never compared: timings and facts about the machine. `why` says which."""
    if not why:
        raise ValueError("why: expected the reason the value is not compared, got ''")
    return {"compare": "recorded", "why": why}


# How far a value's digits move between CPUs' vector kernels and thread counts, relative to its size,
# for a value that is not itself rounding noise (a logit difference of 2.9, an error of 0.09). In float64
# the summation order moves the 15th or 16th digit, and a difference of two logits can lose a few more;
# in float32 a quantised cache's codes can flip where x / scale lands within rounding of a half
# (measured: 3e-5 relative between kernel sets), so the float32 rule leaves a factor 30 of room.
REL_TOL = {torch.float64: 1e-9, torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 1e-2}


def float_rule(dtype: torch.dtype | str, rounding: float = 0.0) -> dict:
    """The rule for floats computed in `dtype`: relative tolerance `REL_TOL[dtype]`; with `rounding`, values
    that are rounding noise (at most that bound, like the logit differences of an exact cache) compare
    equal too, so one rule serves a list that holds both kinds."""
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if dtype not in REL_TOL:
        raise ValueError(f"dtype: expected one of {sorted(map(str, REL_TOL))}, got {dtype}")
    return close(abs_tol=rounding, rel_tol=REL_TOL[dtype])


def rounding_rule(bound: float) -> dict:
    """The rule for a rounding-level difference held to `bound`: any two values at or below the bound
    are the same claim ("equal up to rounding"), whatever their digits."""
    return close(abs_tol=bound)


# -- the machine ---------------------------------------------------------------------------------

def cpu_model() -> str:
    """The CPU's marketing name (Linux: /proc/cpuinfo; macOS: sysctl), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    if platform.system() == "Darwin":
        try:
            out = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                                 timeout=5)
            if out.returncode == 0 and out.stdout.strip():
                return out.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or platform.machine() or "unknown"


def environment() -> dict:
    """What the numbers were measured on (recorded, never compared). `cpu_capability` is the set of
    vector kernels PyTorch dispatches to (DEFAULT, AVX2, AVX512, ...); float digits depend on it."""
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(),
    }


def _plain(value):
    """JSON-friendly copy of numbers, tensors, lists and dicts (NaN and inf become strings)."""
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def finite(value) -> bool:
    """True when every number in `value` (a number, or a list or dict of them) is finite; strings,
    booleans and None hold no number and count as finite."""
    if isinstance(value, torch.Tensor):
        return bool(torch.isfinite(value).all()) if value.is_floating_point() else True
    if isinstance(value, dict):
        return all(finite(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(finite(v) for v in value)
    if isinstance(value, float):
        return math.isfinite(value)
    return True


def write_json_atomic(path: str | Path, document: dict) -> Path:
    """Write `document` to `path` through a temporary file and a rename: never half-written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(document, f, indent=2, sort_keys=False)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


class QAResult:
    """Collects parameters, values and checks for one QA notebook, then writes them."""

    def __init__(self, name: str, parameters: dict, machine_dependent: bool = False) -> None:
        self.doc = {
            "schema_version": SCHEMA_VERSION,
            "name": name,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine_dependent": machine_dependent,
            "parameters": _plain(parameters),
            "environment": environment(),
            "values": {},
            "rules": {},
            "checks": [],
            "passed": True,
        }

    def value(self, key: str, value, rule: dict) -> None:
        """Record a measured value under `key`, with the rule a regenerated value is compared by
        (`exact()`, `close(...)`, `float_rule(dtype)`, `rounding_rule(bound)` or `recorded(why)`)."""
        if not (isinstance(rule, dict) and rule.get("compare") in ("exact", "close", "recorded")):
            raise ValueError(f"rule: expected exact(), close(...) or recorded(...), got {rule!r}")
        self.doc["values"][key] = _plain(value)
        self.doc["rules"][key] = dict(rule)

    def check(self, name: str, claim: str, value, tolerance, comparison: str = "<=") -> bool:
        """Record whether `value <comparison> tolerance` holds, with the claim it supports."""
        if comparison not in COMPARISONS:
            raise ValueError(f"comparison: expected one of {sorted(COMPARISONS)}, got {comparison!r}")
        if isinstance(value, torch.Tensor):
            value = value.item() if value.numel() == 1 else value.tolist()
        # The verdict is taken on the numbers themselves, then they are stored in their JSON-friendly
        # form. A NaN or an infinity measured nothing: it fails under every comparison (NaN fails
        # each on its own, but +inf would pass ">=" and -inf "<=").
        passed = finite(value) and bool(COMPARISONS[comparison](value, tolerance))
        value, tolerance = _plain(value), _plain(tolerance)
        self.doc["checks"].append(
            {"name": name, "claim": claim, "value": value, "tolerance": tolerance,
             "comparison": comparison, "passed": passed}
        )
        self.doc["passed"] = all(c["passed"] for c in self.doc["checks"])
        return passed

    def report(self) -> str:
        """One line per check: verdict, name and measured value as `shown` prints it (the same on every machine)."""
        return "\n".join(f"{'pass' if c['passed'] else 'FAIL'}  {c['name']}: {shown(c)}" for c in self.doc["checks"])

    def write(self, path: str | Path) -> Path:
        """Write atomically, then raise AssertionError if any check failed (a failed QA run exits non-zero)."""
        out = write_json_atomic(path, self.doc)
        failed = [c["name"] for c in self.doc["checks"] if not c["passed"]]
        if failed:
            raise AssertionError(f"QA {self.doc['name']}: failed checks {failed} (written to {out})")
        return out


def repo_root(start: str | Path | None = None) -> Path:
    """The repository root: the nearest folder at or above `start` (default: the working
    directory) that holds `qa/results.schema.json`. Papermill, nbval and jupyter-book start
    kernels in different folders; resolving paths from here makes them agree."""
    here = Path(start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / "qa" / "results.schema.json").is_file():
            return folder
    raise FileNotFoundError(f"start: expected a folder inside the course repository, got {here}")


def resolve_output(output_path: str | Path | None, name: str) -> Path:
    """Where a QA notebook writes its result.

    An empty `output_path` (the notebooks' default) means `qa/_runs/results/<name>.json`,
    which git ignores: a default run (nbval, a reader pressing "run all") never touches the
    committed `qa/results/`. A relative path is taken from the repository root.
    """
    if not output_path:
        return repo_root() / "qa" / "_runs" / "results" / f"{name}.json"
    path = Path(output_path)
    return path if path.is_absolute() else repo_root() / path


def schema_errors(document: dict) -> list[str]:
    """Every way `document` breaks `qa/results.schema.json` (an empty list: valid)."""
    import jsonschema  # imported here: only the tests and the QA notebooks need it

    try:  # an editable install sits inside the repository; otherwise look from the working directory
        root = repo_root(Path(__file__).parent)
    except FileNotFoundError:
        root = repo_root()
    schema = json.loads((root / "qa" / "results.schema.json").read_text())
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    errors = [f"{'/'.join(map(str, e.absolute_path)) or '(document)'}: {e.message}"
              for e in sorted(validator.iter_errors(document), key=lambda e: list(map(str, e.absolute_path)))]
    values, rules = document.get("values"), document.get("rules")
    if isinstance(values, dict) and isinstance(rules, dict) and set(values) != set(rules):
        unruled, orphans = sorted(set(values) - set(rules)), sorted(set(rules) - set(values))
        errors.append(f"rules: expected one rule per value, got values without a rule {unruled} "
                      f"and rules without a value {orphans}")
    return errors


# The largest tolerance this course calls "rounding": float64 logits are held to 1e-12, float32 ones to 1e-4
# (1e-3 for a 124M-parameter model in the benchmark record).
ROUNDING_BOUND = 1e-3


def shown(check: dict) -> str:
    """A check's measured value as a page prints it, the same on every machine.

    A passed rounding-level claim (a `<=` or `<` bound of at most `ROUNDING_BOUND`) prints as the
    claim, "<= 1e-12 (rounding)", since its digits depend on the CPU; anything else prints as
    `fmt` does, followed by the comparison. The exact value stays in the result file.
    """
    value, tol, comparison = check["value"], check["tolerance"], check["comparison"]
    is_float = isinstance(value, float) or (isinstance(value, list) and all(isinstance(v, float) for v in value))
    rounding = (comparison in ("<=", "<") and isinstance(tol, (int, float)) and not isinstance(tol, bool)
                and 0 < tol <= ROUNDING_BOUND)
    if is_float and rounding and check["passed"]:
        return f"{comparison} {fmt(tol)} (rounding)"
    return f"{fmt(value)} {comparison} {fmt(tol)}"


def fmt(value, digits: int = 2) -> str:
    """A measured value for a table: numbers to `digits` significant digits, so that a
    regeneration that moves only the last digits of a rounding-level value prints the same."""
    if isinstance(value, bool) or value is None:
        return str(value).lower() if isinstance(value, bool) else "none"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return "0" if value == 0 else f"{value:.{digits}g}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(fmt(v, digits) for v in value) + "]"
    return str(value)


def load_results(directory: str | Path) -> list[dict]:
    """Every result document in `directory`, sorted by file name, each with its `source` file name."""
    docs = []
    for path in sorted(Path(directory).glob("*.json")):
        doc = json.loads(path.read_text())
        doc["source"] = path.name
        docs.append(doc)
    return docs
