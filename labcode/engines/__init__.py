"""How serving engines manage the cache, in small verified versions (chapter 9).

Each policy is a `labcode.caches.base.KVCache`, so the one GPT runs with it unchanged.
Beside them, run on request only (never imported here): `llamacpp` times the build of
llama.cpp, and `llamacpp_compare` runs llama.cpp on the real model against the course's
model and caches (chapter 9's second page); each writes its own record.
"""

from labcode.engines.batch import ScatteredCache, run_ragged, scattered_mask
from labcode.engines.cells import CellsCache, cells_mask, find_slots
from labcode.engines.kivi import KIVICache, kivi_bytes
from labcode.engines.paged import BlockPool, PagedCache, block_hashes, block_slots
from labcode.engines.quant import (
    QuantizedCache,
    dequantize,
    fake_quantize,
    hadamard,
    key_outlier_ratio,
    quantize,
    with_key_outliers,
)

__all__ = [
    "BlockPool",
    "CellsCache",
    "KIVICache",
    "PagedCache",
    "QuantizedCache",
    "ScatteredCache",
    "block_hashes",
    "block_slots",
    "cells_mask",
    "dequantize",
    "fake_quantize",
    "find_slots",
    "hadamard",
    "key_outlier_ratio",
    "kivi_bytes",
    "quantize",
    "run_ragged",
    "scattered_mask",
    "with_key_outliers",
]
