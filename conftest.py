"""Shared fixtures and hooks, at the repository root so that they apply to the notebooks' items too
(pytest consults a conftest only for the items below its folder).

One clean book build per test session, a local web server for it, and the
Chromium that the browser tests drive.

Every notebook is executed once per test session, by nbval, which compares each cell's output with
the committed one. The session keeps those executions (`_build/test-executed`), and the book is then
built from them, from scratch into `_build/test-book`, with warnings as errors: the pages show
exactly what nbval executed and checked, and no notebook runs twice. A notebook that nbval did not
run in this session (a partial run, or a cell that failed) is executed by the book build itself.
nbval's items run first for this reason. Set KVCV_REUSE_BOOK=1 to reuse an existing build there
while working on the tests themselves (never in CI).
"""

from __future__ import annotations

import functools
import http.server
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import nbformat
import pytest
import yaml

ROOT = Path(__file__).resolve().parent
# No test downloads anything, and none sees a Hugging Face cache the developer may have: chapter 1's
# optional GPT-2 cell then skips itself on every machine (the notebooks' kernels inherit this).
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HOME"] = str(ROOT / "_build" / "empty-hf-home")
# The suite runs several Python processes on the same cores (notebook kernels, the portability pass,
# the unit lane). By default a torch (OpenMP) thread that waits for its peers spins for a while; with
# every core busy, spinning threads take the cores their peers need, and small operations run tens of
# times slower. Waiting threads sleep instead: a change of timing, never of a result.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
BOOK_OUT = ROOT / "_build" / "test-book"
EXECUTED = ROOT / "_build" / "test-executed"  # notebooks as nbval executed them in this session
STAGE = ROOT / "_build" / "test-source"  # the book's sources, with those executions in place
# The portability pass (tests/test_portability.py) runs nbval again under other CPU kernels; its
# executions are checked, never published.
CAPTURE = os.environ.get("KVCV_PORTABILITY") != "1" and os.environ.get("KVCV_LANE") != "1"
# Debian's Chromium; KVCV_CHROMIUM names another Chromium-based browser (CI on macOS uses the runner's Chrome).
CHROMIUM = Path(os.environ.get("KVCV_CHROMIUM") or "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@dataclass
class BookBuild:
    returncode: int
    log: str
    html: Path
    seconds: float


def toc_files(toc_path: Path = ROOT / "_toc.yml") -> list[str]:
    """Every document named in _toc.yml (root first), without its extension."""
    toc = yaml.safe_load(toc_path.read_text())
    found = [toc["root"]]

    def walk(node):
        if isinstance(node, dict):
            if "file" in node:
                found.append(node["file"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(toc.get("parts", toc.get("chapters", [])))
    return found


def _jupyter_book() -> Path:
    exe = Path(sys.executable).with_name("jupyter-book")
    return exe if exe.exists() else ROOT / ".venv" / "bin" / "jupyter-book"


# -- nbval's executions, kept for the book --------------------------------------------------------

def _is_nbval_cell(item) -> bool:
    return type(item).__name__ == "IPyNbCell"


def pytest_collection_modifyitems(session, config, items):
    """Notebook cells first, so that the book, built later in the session, is made of their executions."""
    items[:] = [i for i in items if _is_nbval_cell(i)] + [i for i in items if not _is_nbval_cell(i)]
    if CAPTURE:
        shutil.rmtree(EXECUTED, ignore_errors=True)
    _runs.clear()
    if CAPTURE and any(i.name == PORTABILITY_TEST for i in items):
        sys.path.insert(0, str(ROOT / "tests"))
        from test_portability import launch  # the second pass starts now and runs beside this one

        _portability.append(launch())
    # The whole suite: the unit tests, which need neither the notebooks' executions nor the book, run
    # in a second pytest process at a lower priority, beside the notebooks, on the core nbval leaves
    # idle; tests/test_lanes.py waits for them and fails with their failures.
    lane = [i for i in items if Path(str(i.fspath)).name in LANE_FILES]
    if CAPTURE and lane and any(i.name == LANE_TEST for i in items):
        items[:] = [i for i in items if i not in lane]
        config.hook.pytest_deselected(items=lane)
        files = sorted({str(Path(str(i.fspath)).relative_to(ROOT)) for i in lane})
        _lanes.append(_launch_lane(files))


# tests/ files that run in the unit lane when the whole suite runs (everything but the book, the
# browser, the QA regeneration and the passes that wait for others).
LANE_FILES = {p.name for p in (ROOT / "tests").glob("test_*.py")} - {
    "test_book.py", "test_browser.py", "test_qa.py", "test_portability.py", "test_lanes.py"}
LANE_TEST = "test_unit_tests_beside_the_notebooks_pass"
LANE_LOG = ROOT / "_build" / "unit-lane.log"
_lanes: list = []


@dataclass
class Lane:
    process: subprocess.Popen
    files: list[str]
    log: Path


def background_pytest(args: list[str], log: Path, env: dict, cwd: Path = ROOT, nice: int = 0) -> subprocess.Popen:
    """Start `python -m pytest -q *args` in the background, `nice` steps below this process where the
    platform has nice, with its output in `log`; return at once. The unit lane and the portability
    pass (tests/test_portability.py) start this way."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
    if nice and hasattr(os, "nice"):
        cmd = ["nice", "-n", str(nice), *cmd]
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)


def _launch_lane(files: list[str]) -> Lane:
    # Below the notebooks and the portability pass: the lane takes the time they leave.
    process = background_pytest(files, LANE_LOG, dict(os.environ, KVCV_LANE="1"), nice=10)
    return Lane(process, files, LANE_LOG)


@pytest.fixture(scope="session")
def unit_lane() -> Lane | None:
    """The unit lane started at collection, or None when this session runs the unit tests itself."""
    return _lanes[0] if _lanes else None


PORTABILITY_TEST = "test_notebooks_and_results_hold_under_other_kernels_and_threads"
_portability: list = []  # the background portability pass, when this session runs its test


@pytest.fixture(scope="session")
def portability_pass():
    """The portability pass started at collection (tests/test_portability.py)."""
    if not _portability:
        sys.path.insert(0, str(ROOT / "tests"))
        from test_portability import launch

        _portability.append(launch())
    return _portability[0]


def pytest_sessionfinish(session, exitstatus):
    """Never leave the background pass running (an interrupted session, or its test deselected)."""
    for run in [*_portability, *_lanes]:
        if run.process.poll() is None:
            run.process.kill()
            run.process.wait()


SESSION_START = time.time()
_runs: dict[Path, dict[int, list | None]] = {}  # notebook -> code cell number -> outputs (None: failed)


def executed_whole(notebook: Path) -> bool:
    """True when nbval executed every code cell of `notebook` in this session and each one passed."""
    cells = _runs.get(Path(notebook).resolve(), {})
    nb = nbformat.read(str(notebook), as_version=4)
    return len(cells) == sum(c.cell_type == "code" for c in nb.cells) and all(v is not None for v in cells.values())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    outcome = yield
    if not _is_nbval_cell(item):
        return
    path = Path(str(item.fspath)).resolve()
    cells = _runs.setdefault(path, {})
    cells[item.cell_num] = None if outcome.excinfo is not None or item.test_outputs is None else item.test_outputs
    n_code = sum(c.cell_type == "code" for c in item.parent.nb.cells)
    if CAPTURE and len(cells) == n_code and all(v is not None for v in cells.values()):
        _write_executed(path, item.parent.nb, cells)


def _write_executed(path: Path, nb, outputs: dict[int, list]) -> None:
    """The notebook with every code cell's outputs replaced by what this session's execution printed."""
    nb = nbformat.from_dict(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    for number, cell in enumerate(code):
        cell.outputs = [nbformat.from_dict(o) for o in outputs[number]]
        cell.execution_count = number + 1
        for out in cell.outputs:
            if out.output_type == "execute_result":
                out.execution_count = number + 1
    target = EXECUTED / path.relative_to(ROOT)
    target.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, str(target))


def _stage_sources() -> list[str]:
    """Copy the book's sources to STAGE with this session's executions in place; return the notebooks
    (relative paths) that still need executing because nbval did not run them whole in this session."""
    shutil.rmtree(STAGE, ignore_errors=True)
    skip = {".git", ".venv", "venv", "_build", "test-artifacts", "_runs", "__pycache__", ".ipynb_checkpoints"}
    shutil.copytree(ROOT, STAGE, ignore=lambda folder, names: [n for n in names if n in skip])
    pending = []
    for doc in toc_files():
        source = ROOT / f"{doc}.ipynb"
        if not source.exists():
            continue
        executed = EXECUTED / f"{doc}.ipynb"
        if executed.exists():
            shutil.copyfile(executed, STAGE / f"{doc}.ipynb")
        else:
            pending.append(f"{doc}.ipynb")
    config = yaml.safe_load((STAGE / "_config.yml").read_text())
    executed_docs = [f"{doc}.ipynb" for doc in toc_files() if (EXECUTED / f"{doc}.ipynb").exists()]
    config["execute"]["exclude_patterns"] = executed_docs  # already executed, by nbval, in this session
    (STAGE / "_config.yml").write_text(yaml.safe_dump(config, sort_keys=False))
    return pending


@pytest.fixture(scope="session")
def book_build() -> BookBuild:
    """Build the book from scratch once per session (or reuse one with KVCV_REUSE_BOOK=1)."""
    html = BOOK_OUT / "_build" / "html"
    if os.environ.get("KVCV_REUSE_BOOK") == "1" and (html / "index.html").exists():
        return BookBuild(0, "(reused an existing build)", html, 0.0)
    shutil.rmtree(BOOK_OUT, ignore_errors=True)
    pending = _stage_sources()
    env = dict(os.environ)
    env.pop("MPLBACKEND", None)  # a non-interactive backend would drop every figure
    cmd = [str(_jupyter_book()), "build", str(STAGE), "-W", "--keep-going", "--path-output", str(BOOK_OUT)]
    start = time.perf_counter()
    out = subprocess.run(cmd, cwd=STAGE, env=env, capture_output=True, text=True)
    note = f"executed by the build (nbval did not run them whole): {pending}\n" if pending else ""
    return BookBuild(out.returncode, note + out.stdout + out.stderr, html, time.perf_counter() - start)


@pytest.fixture(scope="session")
def book_html(book_build: BookBuild) -> Path:
    """The built HTML folder; fails the requesting test if the build did not succeed."""
    if book_build.returncode != 0 or not (book_build.html / "index.html").exists():
        pytest.fail("the book build failed (see test_book_builds_with_warnings_as_errors):\n" + book_build.log[-3000:])
    return book_build.html


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - the base class's signature
        pass


@pytest.fixture(scope="session")
def book_server(book_html: Path):
    """Serve the built book on 127.0.0.1 at a free port; yields the base URL (ending in /)."""
    handler = functools.partial(_QuietHandler, directory=str(book_html))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="session")
def chromium_path() -> str:
    """Debian's Chromium; skipped locally when missing, a failure under CI."""
    if CHROMIUM.exists():
        return str(CHROMIUM)
    if os.environ.get("CI"):
        pytest.fail(f"{CHROMIUM} is missing, and the browser tests are required in CI")
    pytest.skip("Chromium not installed; run scripts/setup.sh on a Debian machine")


@pytest.fixture(scope="session")
def browser_type_launch_args(browser_type_launch_args, chromium_path):
    """pytest-playwright's launch options, pointed at Debian's Chromium (never a downloaded one)."""
    return {**browser_type_launch_args, "executable_path": chromium_path, "args": CHROMIUM_ARGS}


@pytest.fixture(scope="session")
def artifacts_dir() -> Path:
    path = ROOT / "test-artifacts"
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: a second thread only adds contention (and float sums can depend on it)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def no_grad():
    """Inference only: no autograd graph is built (the cache tests never train)."""
    import torch

    with torch.no_grad():
        yield
