"""The benchmark suite of chapter 7: `python -m labcode.bench [--quick|--full]`.

Introduced in chapter 7. One module per measurement, each with a `record` that adds its values to the result, all in
one process, interleaved, after a warm-up, summarised by medians and ratios:
  1. the machine: fixed cost per operation, peak, bandwidth, products of few rows (`roofline.record_machine`);
  2. appending one position to every layer, for every cache, and append plus one query's attention (`append`);
  3. greedy generation with no cache and with every cache (`generation`);
  4. every prefill, decode and uncached call predicted and timed (`roofline`); decode against the batch (`batch`);
  5. a decode step against the bandwidth floor, operation by operation; window against concat (`floor`);
  6. whole decode steps against the floor: the model's eager step, leaner eager variants, the step fused and
     compiled, at every preset and the real model (`compiled`; the test sizes never compile);
  7. how many sequences fit in memory, checked by allocating the caches (`memory`);
  8. the record's correctness checks (`correctness`).
`common` holds what they share (the sizes of each mode, the random models, the rule). Timings are recorded, never
compared: the result file is `machine_dependent`, its checks are about correctness only, and the targets are values
with a `met` flag and, where not met, the measured reason (`targets`); `plots` draws them.
"""

from __future__ import annotations

import time
from dataclasses import asdict

import torch

from labcode.bench import append, batch, compiled, correctness, floor, generation, memory, roofline
from labcode.bench.common import SIZES, TIMED, Sizes, random_model
from labcode.bench.roofline import roofline_speedup
from labcode.bench.targets import targets
from labcode.bench.timing import Streamer
from labcode.results import QAResult
from labcode.weights.checkpoint import default_device

__all__ = ["SIZES", "TIMED", "Sizes", "random_model", "roofline_speedup", "run_benchmarks"]


def run_benchmarks(mode: str = "quick", device: torch.device | None = None, progress: bool = True) -> QAResult:
    """Run every benchmark at the sizes of `mode` ("test", "quick" or "full"); return the unwritten result."""
    sizes, device = SIZES[mode], device or default_device()
    started = section = time.perf_counter()
    sections = {}

    def lap(name: str) -> None:
        nonlocal section
        sections[name] = time.perf_counter() - section
        section = time.perf_counter()

    res = QAResult("bench", {"mode": mode, "device": str(device), **asdict(sizes)}, machine_dependent=True)
    # one reader of the bandwidth for the whole run (its packed product compiles once), measured by each section
    streamer = Streamer(sizes.bandwidth_mbytes, device, packed=sizes.compile)
    measured = roofline.record_machine(res, sizes, device, streamer)
    lap("machine")
    append.record(res, sizes, device, progress)
    lap("append")
    models = {}
    generation.record(res, sizes, device, models, progress)
    lap("generation")
    roofline.record(res, sizes, device, measured, models, progress)
    batch.record(res, sizes, device, measured, models, progress)
    lap("roofline")
    model = models.get(sizes.floor_preset) or random_model(sizes.floor_preset, device)
    layouts = floor.record(res, sizes, device, model, streamer, progress)
    del models, model
    lap("floor")
    compiled.record(res, sizes, device, streamer, progress, layouts)
    lap("compiled")
    memory.record(res, sizes)
    lap("memory")
    correctness.record(res)
    lap("flop_checks")
    res.value("targets", targets(res.doc["values"]), TIMED)
    res.value("section_s", sections, TIMED)
    res.value("elapsed_s", time.perf_counter() - started, TIMED)
    return res
