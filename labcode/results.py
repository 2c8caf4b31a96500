"""QA result files: one JSON document per QA notebook, written atomically.

Introduced in the verification report. A document holds the schema version, the
parameters, the environment, measured values and a list of checks (claim, value,
tolerance, comparison, passed), with an overall `passed`. `qa/results.schema.json`
describes the format.
"""

from __future__ import annotations

import json
import math
import os
import platform
import tempfile
from datetime import datetime, timezone
from pathlib import Path

import torch

SCHEMA_VERSION = 1
COMPARISONS = {
    "<=": lambda value, tol: value <= tol,
    ">=": lambda value, tol: value >= tol,
    "==": lambda value, tol: value == tol,
    "<": lambda value, tol: value < tol,
    ">": lambda value, tol: value > tol,
}


def environment() -> dict:
    """What the numbers were measured on (recorded, never compared)."""
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "machine": platform.machine(),
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
            "checks": [],
            "passed": True,
        }

    def value(self, key: str, value) -> None:
        """Record a measured value under `key`."""
        self.doc["values"][key] = _plain(value)

    def check(self, name: str, claim: str, value, tolerance, comparison: str = "<=") -> bool:
        """Record whether `value <comparison> tolerance` holds, with the claim it supports."""
        if comparison not in COMPARISONS:
            raise ValueError(f"comparison: expected one of {sorted(COMPARISONS)}, got {comparison!r}")
        if isinstance(value, torch.Tensor):
            value = value.item() if value.numel() == 1 else value.tolist()
        # The verdict is taken on the numbers themselves (inf or NaN fail a "<=" check), then they
        # are stored in their JSON-friendly form.
        passed = bool(COMPARISONS[comparison](value, tolerance))
        value, tolerance = _plain(value), _plain(tolerance)
        self.doc["checks"].append(
            {"name": name, "claim": claim, "value": value, "tolerance": tolerance,
             "comparison": comparison, "passed": passed}
        )
        self.doc["passed"] = all(c["passed"] for c in self.doc["checks"])
        return passed

    def report(self) -> str:
        """One line per check: verdict, name, measured value, comparison and tolerance (values to 2 digits)."""
        return "\n".join(f"{'pass' if c['passed'] else 'FAIL'}  {c['name']}: {fmt(c['value'])} {c['comparison']} "
                         f"{fmt(c['tolerance'])}" for c in self.doc["checks"])

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
    return [f"{'/'.join(map(str, e.absolute_path)) or '(document)'}: {e.message}"
            for e in sorted(validator.iter_errors(document), key=lambda e: list(map(str, e.absolute_path)))]


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
