"""Timing helpers: synchronised wall-clock timers, medians, per-operation overhead, bandwidth.

Introduced in chapter 7 (and used by chapter 8's kernel timings). Every comparison runs in
one process, interleaved (the order of the contenders rotates every step), after a warm-up,
and is summarised by medians.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

from labcode.checks import fail


def sync(device: torch.device) -> None:
    """Wait for queued device work (CUDA launches return before the kernel has run)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_cpu(fn: Callable[[], object], device: torch.device) -> tuple[float, float]:
    """Wall-clock and process CPU seconds of one call of `fn`.

    On a CPU shared with other jobs, wall time includes the time the scheduler gave to
    them; CPU time does not (it still includes waiting for memory the others also use).
    """
    sync(device)
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    sync(device)
    return time.perf_counter() - t0, time.process_time() - c0


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Wall-clock seconds one call of `fn` takes, including the device work it queues (no CPU clock read inside)."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def median(values: Sequence[float]) -> float:
    """The median, or NaN for no values."""
    return statistics.median(values) if len(values) else float("nan")


def interleaved_samples(fns: dict[str, Callable[[], object]], repeats: int = 20, warmup: int = 3, *,
                        threads: int | None = None, clock: Callable[[], float] = time.perf_counter
                        ) -> dict[str, list[float]]:
    """Seconds per call of each zero-argument function, `repeats` rounds of one call each, after `warmup` rounds.

    The functions take turns within every round, so a busy moment hits all alike and sample i of each comes from
    the same round. `threads` sets torch's thread count for the timing only; `clock` is the wall clock by default
    (`time.process_time`: this process's CPU time only).
    """
    if repeats <= 0 or warmup < 0:
        fail("repeats, warmup", "> 0 and >= 0", f"{repeats}, {warmup}")
    times: dict[str, list[float]] = {name: [] for name in fns}
    with torch_threads(threads):
        for rep in range(warmup + repeats):
            for name, fn in fns.items():
                start = clock()
                fn()
                if rep >= warmup:
                    times[name].append(clock() - start)
    return times


def time_interleaved(fns: dict[str, Callable[[], object]], repeats: int = 20, warmup: int = 3, *,
                     threads: int | None = None, clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Median seconds per call of each zero-argument function, timed in turns (see `interleaved_samples`)."""
    samples = interleaved_samples(fns, repeats, warmup, threads=threads, clock=clock)
    return {name: median(ts) for name, ts in samples.items()}


@contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """torch's CPU thread count set to `threads` inside the block (None: left as it is), restored after: a
    measurement taken the way a record was (the benchmark runs on one thread), without pinning the caller's."""
    if threads is not None and (type(threads) is not int or threads <= 0):
        fail("threads", "a positive int or None", repr(threads))
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def rotated(names: Sequence[str], k: int) -> list[str]:
    """`names` rotated left by k: who goes first changes every step, so no contender always runs cold."""
    k %= max(len(names), 1)
    return list(names[k:]) + list(names[:k])


def rotating_medians(ways: dict[str, Callable[[], object]], rounds: int, device: torch.device) -> dict[str, float]:
    """Median wall seconds of each of `ways`, called once per round in an order that rotates every round, after a
    first round that only warms up."""
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    for r in range(rounds + 1):
        for name in rotated(list(ways), r):
            seconds[name].append(timed(ways[name], device))
    return {name: median(ts[1:]) for name, ts in seconds.items()}


def profiled(run: Callable[[], object], steps: int, device: torch.device, shapes: bool = False) -> tuple[list, float]:
    """torch.profiler's averages over `steps` calls of `run()` (grouped by input shape where `shapes`), and the wall
    seconds per call under the profiler."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, record_shapes=shapes) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            run()
        wall = (time.perf_counter() - t0) / steps
    return prof.key_averages(group_by_input_shape=shapes), wall


def per_call(fn: Callable[[], object], device: torch.device, calls: int = 200, repeats: int = 7) -> float:
    """Median over `repeats` batches of the mean seconds per call of `fn` (for calls of a few microseconds)."""
    fn()
    batches = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync(device)
        batches.append((time.perf_counter() - t0) / calls)
    return median(batches)


OVERHEAD_BUFFER = (1, 3, 256, 64)  # [B, Hkv, S, D] of the buffer `op_overhead` works on


def op_overhead(device: torch.device, dtype: torch.dtype = torch.float32) -> dict[str, float]:
    """Microseconds per call of the smallest things a cache append does, on an `OVERHEAD_BUFFER` buffer; the
    concatenation copies its first half, 128 rows, and one row more into a new tensor."""
    b, hkv, s, d = OVERHEAD_BUFFER
    buf = torch.zeros(b, hkv, s, d, dtype=dtype, device=device)
    row = torch.ones(b, hkv, 1, d, dtype=dtype, device=device)
    empty = row[:, :, :0]
    one = torch.zeros(1, dtype=dtype, device=device)

    def empty_assign():
        buf[:, :, 0:0] = empty

    def row_assign():
        buf[:, :, 5:6] = row

    ops = {
        "view (narrow)": lambda: buf.narrow(2, 5, 1),
        "add_ on one element": lambda: one.add_(1),
        "empty slice assignment": empty_assign,
        "one-row slice assignment": row_assign,
        "one-row narrow().copy_()": lambda: buf.narrow(2, 5, 1).copy_(row),
        "cat of 128 rows and 1 row": lambda: torch.cat((buf[:, :, : s // 2], row), dim=2),
    }
    return {name: per_call(fn, device) * 1e6 for name, fn in ops.items()}


class Streamer:
    """Reads of a matrix far bigger than the caches, several ways; the fastest is the memory bandwidth the floor uses.

    The ways: a matrix-vector product with the matrix stored by row, by column, a sum of every element and, with
    `packed` (it compiles), the product compiled on the matrix packed as the compiled step packs its weights
    (`labcode.fused.packing`). A floor that a step's own kind of read could beat would not be a floor."""

    def __init__(self, mbytes: int, device: torch.device, dtype: torch.dtype = torch.float32,
                 packed: bool = False) -> None:
        cols = 4096
        rows = max(256, mbytes * 2**20 // (cols * torch.finfo(dtype).bits // 8))
        gen = torch.Generator(device="cpu").manual_seed(0)
        self.row_major = torch.randn(rows, cols, generator=gen, dtype=dtype).to(device)  # (rows, cols)
        self.col_major = self.row_major.t().contiguous().t()  # same values, stored column by column
        self.x = torch.randn(cols, generator=gen, dtype=dtype).to(device)
        self.device = device
        self.ways = {"row_major": lambda: torch.mv(self.row_major, self.x),
                     "col_major": lambda: torch.mv(self.col_major, self.x), "sum": lambda: self.row_major.sum()}
        if packed:
            self.ways["packed"] = self._packed()

    def _packed(self) -> Callable[[], torch.Tensor]:
        from labcode.fused import packing

        weight = torch.nn.Parameter(self.row_major, requires_grad=False)  # a constant of the graph, packed there
        product = torch.compile(lambda x: torch.nn.functional.linear(x, weight))
        x = self.x.unsqueeze(0)
        with torch.inference_mode(), packing():
            product(x)

        def read() -> torch.Tensor:
            with torch.inference_mode():  # the mode it was compiled in: another would compile it again
                return product(x)

        return read

    @property
    def nbytes(self) -> int:
        return self.row_major.nbytes

    def measure(self, repeats: int = 3) -> dict[str, float]:
        """Bytes per second of each way of reading the matrix (median of `repeats`), by name, and `best`; with `_cpu`,
        the same in CPU time."""
        out = {}
        for name, way in self.ways.items():
            runs = [timed_cpu(way, self.device) for _ in range(repeats)]
            out[name] = self.nbytes / median([wall for wall, _ in runs])
            out[f"{name}_cpu"] = self.nbytes / max(median([cpu for _, cpu in runs]), 1e-9)
        out["best"] = max(out[name] for name in self.ways)
        out["best_cpu"] = max(out[f"{name}_cpu"] for name in self.ways)
        return out
