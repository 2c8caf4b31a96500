"""Starting N processes that talk over torch.distributed, as users start them: from Python or by torchrun.

Introduced in chapter 10. `launch(fn, N, *args)` runs `fn(rank, N, *args)` in N processes joined in one
gloo process group on loopback and returns their N results in rank order. The rendezvous store is
opened here, on a port the operating system assigns while the store holds it (port 0), so two jobs
started at the same moment, by parallel tests for instance, can never pick the same port. Every job
has a deadline: the process group's collectives give up after `timeout` seconds, and a job still
running then is stopped, all its processes with it. A rank that raises stops the others too, and
`LaunchError` says which rank failed and why.

`torchrun` starts the processes itself and describes the group in environment variables (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT); `join_from_env` joins that group instead
(`python -m labcode.distributed` does either).
"""

from __future__ import annotations

import datetime
import multiprocessing.forkserver as forkserver
import os
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from labcode.checks import fail, is_int

LOOPBACK = "127.0.0.1"
ENV_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # what torchrun sets for each process


class LaunchError(RuntimeError):
    """A job that failed: a rank raised or exited early, or the job ran past its deadline."""


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port on `host` that the operating system reported free (bind to port 0, read it back).

    Another process may take it before it is used again: `launch` does not rely on it, since its
    store keeps the port it binds. Use it for a group started from outside (torchrun's MASTER_PORT).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def loopback_interface() -> str:
    """The name of the loopback network interface ("lo" on Linux, "lo0" on macOS)."""
    names = [name for _, name in socket.if_nameindex() if name.startswith("lo")]
    return names[0] if names else "lo"


def default_start_method() -> str:
    """forkserver where the platform offers it (Linux, macOS), spawn elsewhere.

    The parent of a job holds threads: the rendezvous store serves on one, and a notebook kernel
    or a test runner has more. A child forked straight from such a process copies only the thread
    that forked it, with whatever locks and sockets the others held at that instant; ranks forked
    that way were seen to hang before they joined the group. A fork server is a separate process,
    started once (with torch and the jobs imported, see `launch`) and kept, that has no such
    threads; each rank is forked from it, so a job starts fast and clean. `spawn` starts a fresh
    interpreter per rank that imports torch again: the same guarantees, more seconds per job.
    """
    return "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"


def launch(fn: Callable, nprocs: int, *args, timeout: float = 300.0, method: str | None = None, **kwargs) -> list:
    """Run `fn(rank, nprocs, *args, **kwargs)` in `nprocs` processes joined in one gloo group on loopback.

    Returns what each rank returned, in rank order (`fn` must be importable, and its arguments and
    result picklable: a fork server or spawn pickles them). Raises LaunchError if a rank raises or
    exits early (the other ranks are stopped) or if the job runs past `timeout` seconds (every rank
    is stopped).
    `method` is a multiprocessing start method (default: `default_start_method()`); jobs that run
    at the same time belong in separate processes, not threads of one (with `fork`, a rank copies
    only the thread that forked it, and a lock another thread held at that instant stays held in it).
    """
    if not callable(fn):
        fail("fn", "a function fn(rank, world, *args)", type(fn).__name__)
    if not (is_int(nprocs) and nprocs >= 1):
        fail("nprocs", "a positive number of processes", repr(nprocs))
    if not (isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0):
        fail("timeout", "a positive number of seconds", repr(timeout))
    method = default_start_method() if method is None else method
    if method not in mp.get_all_start_methods():
        fail("method", f"one of {mp.get_all_start_methods()}", repr(method))
    if method == "forkserver":  # taken into account when the server starts, the first time only
        forkserver.set_forkserver_preload(["torch", "torch.distributed", "labcode.distributed.jobs"])
    wait = datetime.timedelta(seconds=timeout)
    # The store binds port 0 and keeps it: the port is this job's from the start (no race with other jobs).
    store = dist.TCPStore(LOOPBACK, 0, world_size=None, is_master=True, wait_for_workers=False, timeout=wait)
    try:
        with tempfile.TemporaryDirectory(prefix="kvcv-job-") as out:
            context = mp.start_processes(_rank_main, args=(fn, nprocs, store.port, out, args, kwargs, timeout),
                                         nprocs=nprocs, join=False, start_method=method)
            _join(context, timeout, out)
            return [torch.load(Path(out) / f"rank{rank}.pt", weights_only=False) for rank in range(nprocs)]
    finally:
        del store  # closes the port


def _first_failure(out: str) -> tuple[int, str] | None:
    """(rank, traceback) of the rank that failed first, from the records the ranks wrote as they raised.

    When one rank raises, its peers then fail too (their connections to it close): the first record
    written is the cause, whichever failed process the operating system reports first.
    """
    records = []
    for path in Path(out).glob("rank*.err"):
        stamp, _, text = path.read_text().partition("\n")
        records.append((int(stamp), int(path.stem.removeprefix("rank")), text))
    return min(records)[1:] if records else None


def _join(context, timeout: float, out: str) -> None:
    """Wait for every rank; stop them all at the deadline; turn a failed rank into LaunchError."""
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=0.05):
            if time.monotonic() > deadline:
                running = [rank for rank, p in enumerate(context.processes) if p.is_alive()]
                _stop(context.processes)
                raise LaunchError(f"timeout: expected the job to finish within {timeout:g} s, "
                                  f"got ranks {running} still running (stopped)")
    except mp.ProcessRaisedException as e:
        _stop(context.processes)
        rank, text = _first_failure(out) or (e.error_index, e.msg)
        lines = [line for line in text.strip().splitlines() if line.strip()]
        error = LaunchError(f"rank {rank} raised {lines[-1] if lines else 'an exception'}")
        error.traceback = text  # the failed rank's whole traceback
        raise error from None
    except mp.ProcessExitedException as e:
        _stop(context.processes)
        raise LaunchError(f"rank {e.error_index} exited with code {e.exit_code} before returning") from None


def _stop(processes) -> None:
    """Terminate, then kill, every process still alive, and reap them all."""
    for p in processes:
        if p.is_alive():
            p.terminate()
    for p in processes:
        p.join(timeout=2)
        if p.is_alive():
            p.kill()
            p.join()


def _rank_main(rank: int, fn: Callable, world: int, port: int, out: str, args: tuple, kwargs: dict,
               timeout: float) -> None:
    """One process of a job: join the group through the parent's store, run fn, save its result."""
    # A notebook kernel's output streams belong to the parent process: write to this process's own.
    sys.stdout = sys.__stdout__ or sys.stdout
    sys.stderr = sys.__stderr__ or sys.stderr
    # N processes share the machine's cores; one thread each keeps them from fighting over them.
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())  # gloo's own sockets on loopback too
    wait = datetime.timedelta(seconds=timeout)
    store = dist.TCPStore(LOOPBACK, port, world_size=None, is_master=False, timeout=wait)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=wait)
    try:
        try:
            result = fn(rank, world, *args, **kwargs)
        except BaseException:
            # Recorded before this process leaves the group: its peers fail only after this.
            record = Path(out) / f"rank{rank}.err"
            record.with_suffix(".err-tmp").write_text(f"{time.monotonic_ns()}\n{traceback.format_exc()}")
            record.with_suffix(".err-tmp").rename(record)
            raise
        dist.barrier()  # nobody leaves while another rank may still send to it
        path = Path(out) / f"rank{rank}.pt"
        torch.save(result, path.with_suffix(".tmp"))
        path.with_suffix(".tmp").rename(path)  # the parent never reads half a file
    finally:
        dist.destroy_process_group()


def torchrun_world() -> tuple[int, int] | None:
    """(rank, world size) when this process was started by torchrun (its environment variables), else None."""
    if not all(name in os.environ for name in ENV_VARS):
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def join_from_env(timeout: float = 60.0) -> tuple[int, int]:
    """Join the gloo group that torchrun described in the environment; return (rank, world size)."""
    found = torchrun_world()
    if found is None:
        missing = [name for name in ENV_VARS if name not in os.environ]
        fail("environment", f"torchrun's variables {list(ENV_VARS)}", f"{missing} missing")
    if os.environ["MASTER_ADDR"] in ("127.0.0.1", "localhost", "::1"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=timeout))
    return found
