"""What running llama.cpp here would cost: the build of `llama-cpp-python`, timed.

Introduced in chapter 9. `llama-cpp-python` is published as a source archive only, so installing
it compiles llama.cpp with CMake. This module downloads the archive, then builds a wheel from it
into a temporary folder (nothing is installed or kept), and records the two times, the CPU time
the build used, the cores and the CPU. The course's rule: a fresh clone's test command must finish
within `TEST_COMMAND_BUDGET_S` on two cores; chapter 9 quotes this record to decide whether
llama.cpp fits. Run it with

    python -m labcode.engines.llamacpp --out qa/results/llamacpp_build.json
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from labcode.results import QAResult, exact, recorded

VERSION = "0.3.36"
CMAKE_ARGS = "-DGGML_NATIVE=OFF"  # portable: no -march=native, so the build is the same on every x86-64 machine
TEST_COMMAND_BUDGET_S = 600  # what a setup step of the test command may take (the whole command: 15 minutes, 2 cores)


def pip_command(action: str, version: str, dest: Path, source: str | None = None) -> list[str]:
    """`pip download` (the source archive) or `pip wheel` (the build) of llama-cpp-python into `dest`."""
    target = source or f"llama-cpp-python=={version}"
    if action == "download":
        return [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--no-cache-dir",
                target, "-d", str(dest)]
    if action == "wheel":
        return [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-cache-dir", target, "-w", str(dest)]
    raise ValueError(f"action: expected 'download' or 'wheel', got {action!r}")


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _run(cmd: list[str], env: dict, timeout: float) -> tuple[float, float, subprocess.CompletedProcess]:
    """Wall seconds, CPU seconds of the children, and the finished process."""
    cpu0, start = _children_cpu_seconds(), time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    return time.perf_counter() - start, _children_cpu_seconds() - cpu0, proc


def _last_line(text: str, folder: str) -> str:
    """The last line of pip's error output, without the temporary folder's path."""
    lines = text.strip().splitlines() or ["no output"]
    return lines[-1].replace(folder, "<temporary folder>")


def tool_version(tool: str) -> str:
    """The first line of `tool --version`, or 'absent'."""
    if shutil.which(tool) is None:
        return "absent"
    out = subprocess.run([tool, "--version"], capture_output=True, text=True)
    return (out.stdout or out.stderr).splitlines()[0].strip() if out.returncode == 0 else "unknown"


def time_build(version: str = VERSION, timeout: float = 3600, keep_wheel: str | Path | None = None) -> dict:
    """Download the source archive, then build its wheel, in a temporary folder; times and outcome.
    `keep_wheel`: a folder to copy the built wheel to (to install it without building again)."""
    env = {**os.environ, "CMAKE_ARGS": CMAKE_ARGS}
    load_before = os.getloadavg()[0]  # other work on the machine slows the build: say how much there was
    with tempfile.TemporaryDirectory(prefix="llamacpp-build-") as tmp:
        src, out = Path(tmp) / "src", Path(tmp) / "wheel"
        dl_s, _, dl = _run(pip_command("download", version, src), env, timeout)
        archives = sorted(src.glob("llama_cpp_python-*")) if dl.returncode == 0 else []
        result = {"download_seconds": dl_s, "archive": archives[0].name if archives else None,
                  "archive_bytes": archives[0].stat().st_size if archives else 0, "build_seconds": None,
                  "build_cpu_seconds": None, "wheel": None, "wheel_bytes": 0, "error": None,
                  "load_average": [load_before, None]}
        if not archives:
            result["error"] = "download failed: " + _last_line(dl.stderr, tmp)
            return result
        build_s, cpu_s, built = _run(pip_command("wheel", version, out, str(archives[0])), env, timeout)
        wheels = sorted(out.glob("llama_cpp_python-*.whl"))
        result.update(build_seconds=build_s, build_cpu_seconds=cpu_s, wheel=wheels[0].name if wheels else None,
                      wheel_bytes=wheels[0].stat().st_size if wheels else 0,
                      load_average=[load_before, os.getloadavg()[0]])
        if built.returncode != 0 or not wheels:
            result["error"] = "build failed: " + _last_line(built.stderr, tmp)
        elif keep_wheel is not None:
            Path(keep_wheel).mkdir(parents=True, exist_ok=True)
            shutil.copy2(wheels[0], Path(keep_wheel) / wheels[0].name)
        return result


def record(measured: dict, version: str = VERSION) -> QAResult:
    """The result document of one timed build (`time_build`'s dict): machine facts recorded, never compared."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    # Named after this module: the verification report names `python -m labcode.bench.<name>` as the writer.
    qa = QAResult("llamacpp", {"version": version, "cmake_args": CMAKE_ARGS,
                                     "budget_seconds": TEST_COMMAND_BUDGET_S}, machine_dependent=True)
    why = "a timing of this machine's build"
    qa.value("download_seconds", measured["download_seconds"], recorded(why))
    qa.value("build_seconds", measured["build_seconds"], recorded(why))
    qa.value("build_cpu_seconds", measured["build_cpu_seconds"], recorded("CPU time of the build's processes"))
    total = None if measured["build_seconds"] is None else measured["download_seconds"] + measured["build_seconds"]
    qa.value("total_seconds", total, recorded(why))
    qa.value("budget_fraction", None if total is None else total / TEST_COMMAND_BUDGET_S, recorded(why))
    qa.value("cores", cores, recorded("a fact of this machine"))
    qa.value("load_average", measured["load_average"], recorded("1-minute load before the download and after the "
                                                                "build: other work on the machine"))
    qa.value("tools", {"cmake": tool_version("cmake"), "ninja": tool_version("ninja"), "gcc": tool_version("gcc")},
             recorded("the build tools of this machine"))
    qa.value("archive", measured["archive"], exact())
    qa.value("archive_bytes", measured["archive_bytes"], recorded("the registry's file"))
    qa.value("wheel", measured["wheel"], recorded("its platform tag names this machine's platform"))
    qa.value("wheel_bytes", measured["wheel_bytes"], recorded("depends on the compiler"))
    qa.value("error", measured["error"], recorded("why the build failed, if it did"))
    qa.check("llamacpp/wheel_built", f"llama-cpp-python {version} builds from source into a wheel here",
             measured["wheel"] is not None and measured["error"] is None, True, "==")
    return qa


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m labcode.engines.llamacpp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="result file, e.g. qa/results/llamacpp_build.json")
    parser.add_argument("--version", default=VERSION, help="llama-cpp-python version (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per pip call (default: %(default)s)")
    parser.add_argument("--keep-wheel", metavar="DIR", default=None,
                        help="copy the built wheel here (pip install it later without building again)")
    args = parser.parse_args(argv)
    print(f"downloading and building llama-cpp-python {args.version} (CMAKE_ARGS={CMAKE_ARGS}); "
          "about 4 minutes of every core on a 2-core machine")
    qa = record(time_build(args.version, args.timeout, args.keep_wheel), args.version)
    values = qa.doc["values"]
    if values["error"]:
        print(values["error"])
    else:
        print(f"download {values['download_seconds']:.0f} s, build {values['build_seconds']:.0f} s "
              f"({values['build_cpu_seconds']:.0f} s of CPU on {values['cores']} cores): "
              f"{values['total_seconds'] / TEST_COMMAND_BUDGET_S:.0%} of the test command's budget")
    return write_record(qa, args.out)


def write_record(qa: QAResult, out: str | Path) -> int:
    """Write a record; the exit status of the command that measured it (1, with the reason, when a check failed)."""
    try:
        qa.write(out)
    except AssertionError as e:
        print(e)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
