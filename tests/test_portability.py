"""The committed outputs and results hold on another CPU, not only on the one that wrote them.

PyTorch picks its vector kernels by CPU (DEFAULT, AVX2, AVX512 on x86-64), and float results
differ in their last digits between kernel sets and between thread counts. So the suite runs the
checks that compare against committed numbers a second time, in a fresh pytest process, under a
kernel set other than the one this session uses (`ATEN_CPU_CAPABILITY`) and another thread count
(`OMP_NUM_THREADS`): nbval on every chapter and QA notebook, and the regeneration of every QA
result with its comparison. An honest machine passes both; a broken cache fails both.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT

# Kernel sets from the plainest up, as torch.backends.cpu.get_cpu_capability() names them.
ORDER = ["DEFAULT", "VSX", "ZVECTOR", "SVE128", "SVE256", "AVX2", "AVX512"]


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


@pytest.mark.skipif(os.environ.get("KVCV_PORTABILITY") == "1", reason="already inside the portability pass")
def test_notebooks_and_results_hold_under_other_kernels_and_threads():
    current, native = torch.backends.cpu.get_cpu_capability(), native_capability()
    other = other_capability(current, native)
    threads = 1 if torch.get_num_threads() > 1 else 2
    env = dict(os.environ, KVCV_PORTABILITY="1", OMP_NUM_THREADS=str(threads))
    env.pop("MPLBACKEND", None)
    if other is not None:
        env["ATEN_CPU_CAPABILITY"] = other.lower()
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "notebooks", "qa",
           "tests/test_qa.py::test_regenerated_result_matches_committed"]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    where = f"kernels {other or current} (this session: {current}), {threads} thread(s)"
    summary = [line for line in out.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    assert out.returncode == 0, (f"under {where} the committed outputs or results do not reproduce:\n"
                                 + "\n".join(summary) + "\n\n" + out.stdout[-6000:] + out.stderr[-2000:])
    assert " passed" in out.stdout.splitlines()[-1], out.stdout[-2000:]
