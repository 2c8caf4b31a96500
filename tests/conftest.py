"""Shared fixtures: one clean book build per test session, a local web server for it, and the
Chromium that the browser tests drive.

The book is built once, from scratch, into `_build/test-book` inside the repository, with every
notebook executed and warnings as errors. Set KVCV_REUSE_BOOK=1 to reuse an existing build there
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

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
BOOK_OUT = ROOT / "_build" / "test-book"
CHROMIUM = Path("/usr/bin/chromium")
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


@pytest.fixture(scope="session")
def book_build() -> BookBuild:
    """Build the book from scratch once per session (or reuse one with KVCV_REUSE_BOOK=1)."""
    html = BOOK_OUT / "_build" / "html"
    if os.environ.get("KVCV_REUSE_BOOK") == "1" and (html / "index.html").exists():
        return BookBuild(0, "(reused an existing build)", html, 0.0)
    shutil.rmtree(BOOK_OUT, ignore_errors=True)
    env = dict(os.environ)
    env.pop("MPLBACKEND", None)  # a non-interactive backend would drop every figure
    cmd = [str(_jupyter_book()), "build", str(ROOT), "-W", "--keep-going", "--path-output", str(BOOK_OUT)]
    start = time.perf_counter()
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    return BookBuild(out.returncode, out.stdout + out.stderr, html, time.perf_counter() - start)


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
