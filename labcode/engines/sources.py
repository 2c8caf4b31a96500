"""What the course read in the engines' sources: one row per constant, naming the file and the
function it was read from, and the version of each engine that was read.

Introduced in chapter 9, whose prose glues every engine constant from here, so that a number
stated about an engine has one place that says where it came from. Rows marked `installed` are
also checked against the package installed here (`tests/test_engine_sources.py`); the others
were read in the engine's repository at the version in `VERSIONS` and cannot be run here.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata


@dataclass(frozen=True)
class Source:
    """One constant read from an engine: its value, what it is, and where it was read."""

    key: str
    value: int
    what: str
    repo: str
    file: str
    where: str  # the function, class or macro that holds it
    installed: bool = False  # also checked against the installed package


# The versions read (transformers: the one installed, see `versions`).
VERSIONS = {"vllm": "0.33.0", "llama.cpp": "0c1e570", "candle": "0.11.0"}

SOURCES: tuple[Source, ...] = (
    Source("llama_max_seq", 256, "sequences a cell's owner bitset can hold",
           "ggml-org/llama.cpp", "src/llama-cparams.h", "LLAMA_MAX_SEQ (the bitset in "
           "llama_kv_cells, src/llama-kv-cells.h)"),
    Source("llama_n_kv_pad", 256, "n_kv, the cells attention reads, is padded to a multiple of this",
           "ggml-org/llama.cpp", "src/llama-kv-cache.cpp", "llama_kv_cache::get_n_kv"),
    Source("llama_rot_block", 64, "head sizes are rotated only when a multiple of this; the values' "
           "rotation block and the smallest key rotation block", "ggml-org/llama.cpp",
           "src/llama-kv-cache.cpp", "llama_kv_cache::llama_kv_cache (the constructor)"),
    Source("vllm_block_size", 16, "tokens per block when no block size is given",
           "vllm-project/vllm", "vllm/config/cache.py", "CacheConfig.DEFAULT_BLOCK_SIZE"),
    Source("llama_head_dim", 128, "head size of the default Llama configuration "
           "(hidden_size / num_attention_heads)", "huggingface/transformers",
           "src/transformers/models/llama/configuration_llama.py", "LlamaConfig.__init__",
           installed=True),
)


def source(key: str) -> Source:
    """The row for `key`; KeyError names the keys there are."""
    for row in SOURCES:
        if row.key == key:
            return row
    raise KeyError(f"key: expected one of {[r.key for r in SOURCES]}, got {key!r}")


def value(key: str) -> int:
    """The constant read from the engine's source under `key`."""
    return source(key).value


def versions() -> dict[str, str]:
    """The engine versions read, with transformers' read from the installed package."""
    return {**VERSIONS, "transformers": metadata.version("transformers")}
