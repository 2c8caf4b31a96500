"""The llama.cpp build benchmark (`labcode.engines.llamacpp`), without building anything: pip is faked.

The real measurement takes minutes of every core and is recorded in qa/results/llamacpp_build.json.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from labcode.engines import llamacpp
from labcode.results import schema_errors


def fake_pip(build_ok: bool = True, download_ok: bool = True):
    """A stand-in for subprocess.run that writes what pip would write, and records the calls."""
    calls = []

    def run(cmd, env=None, **kwargs):
        if cmd[1:3] != ["-m", "pip"]:  # `cmake --version` and the like
            return subprocess.CompletedProcess(cmd, 0, f"{cmd[0]} version 1.0\n", "")
        calls.append((cmd, env))
        action, dest = cmd[3], Path(cmd[cmd.index("-d" if "-d" in cmd else "-w") + 1])
        ok = download_ok if action == "download" else build_ok
        if ok:
            dest.mkdir(parents=True, exist_ok=True)
            name = "llama_cpp_python-0.3.36.tar.gz" if action == "download" else \
                "llama_cpp_python-0.3.36-cp311-cp311-linux_x86_64.whl"
            (dest / name).write_bytes(b"x" * 10)
        stderr = "" if ok else f"ERROR: Failed building wheel in {dest}"
        return subprocess.CompletedProcess(cmd, 0 if ok else 1, "", stderr)

    return run, calls


def test_the_commands_pin_the_version_and_keep_nothing():
    dl = llamacpp.pip_command("download", "0.3.36", Path("src"))
    wheel = llamacpp.pip_command("wheel", "0.3.36", Path("out"), "src/llama_cpp_python-0.3.36.tar.gz")
    assert dl[3] == "download" and "llama-cpp-python==0.3.36" in dl and "--no-binary" in dl
    assert wheel[3] == "wheel" and "--no-deps" in wheel and "--no-cache-dir" in wheel and wheel[-2:] == ["-w", "out"]
    with pytest.raises(ValueError, match="^action: expected 'download' or 'wheel', got 'install'"):
        llamacpp.pip_command("install", "0.3.36", Path("x"))


def test_a_timed_build_is_a_recorded_benchmark(monkeypatch, tmp_path):
    run, calls = fake_pip()
    monkeypatch.setattr(llamacpp.subprocess, "run", run)
    measured = llamacpp.time_build(keep_wheel=tmp_path / "kept")
    assert [p.name for p in (tmp_path / "kept").iterdir()] == [measured["wheel"]]
    assert [c[0][3] for c in calls] == ["download", "wheel"]
    assert all(env["CMAKE_ARGS"] == "-DGGML_NATIVE=OFF" for _, env in calls)
    assert calls[1][0][-3].endswith("llama_cpp_python-0.3.36.tar.gz")  # the build reads the downloaded archive
    qa = llamacpp.record(measured)
    doc = qa.doc
    assert doc["machine_dependent"] and doc["passed"] and schema_errors(doc) == []
    assert doc["values"]["wheel"].endswith(".whl") and doc["values"]["build_seconds"] >= 0
    timings = ["download_seconds", "build_seconds", "build_cpu_seconds", "total_seconds", "cores"]
    assert all(doc["rules"][k]["compare"] == "recorded" for k in timings)
    qa.write(tmp_path / "llamacpp_build.json")


@pytest.mark.parametrize("build_ok,download_ok,reason", [(False, True, "build failed"),
                                                         (True, False, "download failed")])
def test_a_failed_build_fails_its_check(monkeypatch, tmp_path, capsys, build_ok, download_ok, reason):
    run, _ = fake_pip(build_ok, download_ok)
    monkeypatch.setattr(llamacpp.subprocess, "run", run)
    assert llamacpp.main(["--out", str(tmp_path / "r.json")]) == 1
    out = capsys.readouterr().out
    assert reason in out and "llamacpp/wheel_built" in out and "<temporary folder>" in out
    assert (tmp_path / "r.json").exists()  # written anyway, so the reason can be read
