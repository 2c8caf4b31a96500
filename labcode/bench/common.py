"""What every measurement of the benchmark shares: how much each runs (`Sizes`, the named modes in `SIZES`), the
rule of its values, the random models it times, and its progress bars.

Introduced in chapter 7.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from labcode.bench.layout import store_wide_weights_by_column
from labcode.config import get_config
from labcode.model import GPT
from labcode.results import recorded


@dataclass(frozen=True)
class Sizes:
    """How much each benchmark runs. `SIZES` holds the named modes."""

    append_layers: int = 30
    append_prefills: tuple[int, int] = (128, 4096)  # the "candle" setup and the "long" one
    append_decode: int = 200
    append_rounds: int = 3
    attention_decode: int = 200
    attention_rounds: int = 3
    # (preset, prompt length, new tokens, rounds) for each end-to-end generation benchmark
    generation: tuple[tuple[str, int, int, int], ...] = (("tiny", 16, 48, 5), ("gpt2-124m", 64, 128, 1))
    floor_preset: str = "gpt2-124m"  # the model whose decode steps are held against the bandwidth floor
    bandwidth_mbytes: int = 256
    profile_position: int = 512
    profile_steps: int = 3  # 0: no torch.profiler table (its first use costs seconds)
    # decode at the floor, operation by operation (labcode.bench.floor), and window against concat per step
    floor_ops_position: int = 512
    floor_ops_steps: int = 7
    kv_read_lengths: tuple[int, ...] = (128, 512, 1000)
    window_concat_positions: tuple[int, ...] = (0, 128, 256, 512, 768, 1000)
    window_concat_steps: int = 9
    window_concat_rounds: int = 2
    # the roofline (labcode.bench.roofline): the machine, the presets, and the calls timed at each
    overhead_preset: str = "gpt2-124m"  # whose shrunk decode step measures the fixed cost per operation
    overhead_min_s: float = 0.5  # seconds of shrunk decode steps timed for it
    rows_shape: tuple[int, int] = (3072, 768)  # the weight through which products of few rows are timed
    roofline_presets: tuple[str, ...] = ("gpt2-124m", "small", "tiny")
    roofline_prefill: tuple[tuple[int, int], ...] = ((16, 0), (64, 0), (256, 0), (64, 512))  # (T, S)
    roofline_decode: tuple[float, ...] = (0.0, 0.25, 0.5, 1.0)  # where decode starts, as a fraction of the table
    roofline_uncached: tuple[int, ...] = (32, 128, 512)
    roofline_repeats: int = 5
    roofline_min_s: float = 1.0  # each point is timed in rounds until its calls add up to this
    roofline_overhead_steps: int = 3  # shrunk decode steps timed after each round: the fixed cost beside each call
    # decode against the batch size (labcode.bench.batch): (preset, batch sizes, cached lengths)
    batch_runs: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...] = (
        ("tiny", (1, 2, 4, 8, 16, 32, 64), (16, 48)),
        ("small", (1, 2, 4, 8, 16, 32, 64), (128, 896)),
        ("gpt2-124m", (1, 2, 4, 8, 16), (128, 896)),
    )
    batch_steps: int = 5
    batch_min_s: float = 1.0  # each batch is timed in rounds of `batch_steps` steps until they add up to this
    stream_mbytes: int = 64  # at least this many MB of each weight shape in the memory-side ceilings' probe
    decode_min_rounds: int = 3  # rounds every decode point takes at least: the ceilings beside it, a median of three
    # whole decode steps against the floor (labcode.bench.compiled): the model's eager step, the fused step eager and
    # compiled, and at `floor_preset` (always timed) the eager variants; positions as fractions of the room in each
    # preset's buffers (its context, at most `compiled_capacity`); `compile` False times the eager steps only
    compiled_presets: tuple[str, ...] = ("tiny", "small", "gpt2-124m", "smollm2-135m")
    row_major_presets: tuple[str, ...] = ("smollm2-135m",)  # beside the floor's: also timed with row-major weights
    compiled_positions: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    compiled_capacity: int = 1024
    compiled_steps: int = 7
    compiled_rounds: int = 3
    compile: bool = True
    # how many sequences fit (labcode.bench.memory)
    memory_budget_gib: float = 16.0
    memory_lengths: tuple[int, ...] = (100, 500, 1000)
    memory_block_size: int = 16


SIZES = {
    "full": Sizes(),
    "quick": Sizes(append_decode=24, append_rounds=2, attention_decode=24, attention_rounds=2,
                   generation=(("tiny", 16, 32, 3), ("gpt2-124m", 16, 12, 1)),
                   bandwidth_mbytes=128, profile_steps=0, floor_ops_steps=3, kv_read_lengths=(512,),
                   window_concat_positions=(0, 512, 1000), window_concat_steps=5, window_concat_rounds=1,
                   roofline_presets=("small", "tiny"), roofline_prefill=((16, 0), (128, 0)),
                   roofline_decode=(0.0, 1.0), roofline_uncached=(64,), roofline_repeats=3,
                   roofline_min_s=0.2, overhead_min_s=0.2,
                   batch_runs=(("tiny", (1, 4, 16), (16,)), ("small", (1, 4, 16), (128,))), batch_steps=3,
                   batch_min_s=0.2, stream_mbytes=32, decode_min_rounds=2,
                   compiled_presets=("tiny", "small"), compiled_steps=5, compiled_rounds=2),
    "test": Sizes(append_layers=3, append_prefills=(16, 256), append_decode=4, append_rounds=1,
                  attention_decode=4, attention_rounds=1, generation=(("micro", 4, 5, 1), ("tiny", 4, 5, 1)),
                  floor_preset="tiny", bandwidth_mbytes=8,
                  profile_steps=0, floor_ops_position=20, floor_ops_steps=2,
                  kv_read_lengths=(32,), window_concat_positions=(0, 40), window_concat_steps=2,
                  window_concat_rounds=1, roofline_presets=("tiny",), roofline_prefill=((8, 0), (8, 16)),
                  roofline_decode=(0.0, 0.5), roofline_uncached=(16,), roofline_repeats=2,
                  roofline_min_s=0.0, roofline_overhead_steps=1, overhead_min_s=0.0,
                  batch_runs=(("tiny", (1, 2), (8,)),), batch_steps=2, batch_min_s=0.0, stream_mbytes=1,
                  decode_min_rounds=1, memory_budget_gib=0.001,
                  memory_lengths=(20,), memory_block_size=8, overhead_preset="tiny", rows_shape=(256, 64),
                  compiled_presets=("tiny",), compiled_positions=(0.0, 1.0), compiled_steps=2, compiled_rounds=1,
                  compile=False),
}


# Every value of the benchmark record is a measurement of the machine that ran it: recorded, never compared.
TIMED = recorded("benchmark measurements of the machine that ran them")


def random_model(preset: str, device: torch.device, seed: int = 0) -> GPT:
    """A model of `preset` with random weights, its wide weights stored by column (`bench.layout`), in eval mode;
    the global RNG is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT(get_config(preset))
    return store_wide_weights_by_column(model).to(device).eval()


def bar(total: int, desc: str, enabled: bool):
    """A progress bar of `total` steps, shown only where `enabled`."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, leave=False)
