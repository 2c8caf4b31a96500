"""How serving engines manage the cache, in small verified versions (chapter 9).

Each policy is a `labcode.caches.base.KVCache`, so the one GPT runs with it unchanged.
"""

from labcode.engines.batch import ScatteredCache, run_ragged, scattered_mask
from labcode.engines.cells import CellsCache, cells_mask, find_slots
from labcode.engines.kivi import KIVICache, kivi_bytes
from labcode.engines.paged import BlockPool, PagedCache, block_hashes, block_slots
from labcode.engines.quant import QuantizedCache, dequantize, fake_quantize, hadamard, quantize, with_key_outliers

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
    "kivi_bytes",
    "quantize",
    "run_ragged",
    "scattered_mask",
    "with_key_outliers",
]
