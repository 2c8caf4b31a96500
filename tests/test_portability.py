"""The committed outputs and results hold on another CPU, not only on the one that wrote them.

PyTorch picks its vector kernels by CPU (DEFAULT, AVX2, AVX512 on x86-64), and float results
differ in their last digits between kernel sets and between thread counts. So the suite runs the
checks that compare against committed numbers a second time, in a fresh pytest process, under a
kernel set other than the one this session uses (`ATEN_CPU_CAPABILITY`) and another thread count
(`OMP_NUM_THREADS`): nbval on every chapter and QA notebook, and the regeneration of every QA
result with its comparison. An honest machine passes both; a broken cache fails both.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from conftest import ROOT, background_pytest

# Kernel sets from the plainest up, as torch.backends.cpu.get_cpu_capability() names them.
ORDER = ["DEFAULT", "VSX", "ZVECTOR", "SVE128", "SVE256", "AVX2", "AVX512"]


@functools.cache
def native_capability() -> str:
    """The kernel set PyTorch picks on this CPU when nothing forces one."""
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    code = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    return out.stdout.strip()


def other_capability(current: str, native: str) -> str | None:
    """A kernel set this CPU can run other than `current`: DEFAULT unless that is the current one, then
    the CPU's own. None when the CPU has only one (then only the thread count changes)."""
    if current != "DEFAULT":
        return "DEFAULT"
    return native if native != "DEFAULT" else None


def test_other_capability_is_a_different_one_the_cpu_has():
    assert other_capability("AVX2", "AVX2") == "DEFAULT"
    assert other_capability("AVX512", "AVX512") == "DEFAULT"
    assert other_capability("DEFAULT", "AVX512") == "AVX512"
    assert other_capability("DEFAULT", "DEFAULT") is None
    current = torch.backends.cpu.get_cpu_capability()
    other = other_capability(current, native_capability())
    assert other != current and (other is None or ORDER.index(other) <= ORDER.index(native_capability()))


PASS_ROOT = ROOT / "_build" / "portability"  # a copy of the sources: the two passes share no files
PASS_LOG = ROOT / "_build" / "portability.log"


@dataclass
class PortabilityPass:
    process: subprocess.Popen
    where: str
    log: Path


def launch() -> PortabilityPass:
    """Start the second pass in the background, in a copy of the sources, and return at once.

    The main session starts it as soon as it has collected its tests (conftest.py), so the
    two passes share the machine's cores instead of running one after the other; the test below
    waits for it and reads its verdict.
    """
    current, native = torch.backends.cpu.get_cpu_capability(), native_capability()
    other = other_capability(current, native)
    threads = 1 if torch.get_num_threads() > 1 else 2
    env = dict(os.environ, KVCV_PORTABILITY="1", OMP_NUM_THREADS=str(threads))
    env.pop("MPLBACKEND", None)
    if other is not None:
        env["ATEN_CPU_CAPABILITY"] = other.lower()
    shutil.rmtree(PASS_ROOT, ignore_errors=True)
    skip = {".git", ".venv", "venv", "_build", "_runs", "test-artifacts", "__pycache__", ".ipynb_checkpoints"}
    shutil.copytree(ROOT, PASS_ROOT, ignore=lambda folder, names: [n for n in names if n in skip])
    # Below the main session's notebooks, whose book build and browser tests come after them and use
    # one core: the pass takes what they leave, and the other core once they are done.
    process = background_pytest(["notebooks", "qa", "tests/test_qa.py::test_regenerated_result_matches_committed"],
                                PASS_LOG, env, cwd=PASS_ROOT, nice=5)
    return PortabilityPass(process, f"kernels {other or current} (this session: {current}), {threads} thread(s)",
                           PASS_LOG)


@pytest.mark.skipif(os.environ.get("KVCV_PORTABILITY") == "1", reason="already inside the portability pass")
def test_notebooks_and_results_hold_under_other_kernels_and_threads(portability_pass):
    returncode = portability_pass.process.wait()
    out = portability_pass.log.read_text()
    summary = [line for line in out.splitlines() if line.startswith(("FAILED", "ERROR"))]
    assert returncode == 0, (f"under {portability_pass.where} the committed outputs or results do not reproduce:\n"
                             + "\n".join(summary) + "\n\n" + out[-8000:])
    assert " passed" in out.strip().splitlines()[-1], out[-2000:]
