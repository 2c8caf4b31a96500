"""Reading a GGUF file, llama.cpp's format: its metadata, and its tensors dequantized to float32.

Introduced in chapter 1, where the real model comes from one. The `gguf` package parses the
container (header, metadata, where each tensor's bytes lie); the dequantization is ours, so that the
formats are on the page: a Q4_1 block holds 32 weights as 4-bit integers q with a float16 scale d and
minimum m (weight = d * q + m, 20 bytes for 32 weights), a Q8_0 block 32 signed bytes with one
float16 scale (weight = d * q, 34 bytes). The tests check it bit for bit against `gguf`'s own.

GGUF writers reorder the rows of Q and K for llama.cpp's rotary layout: `unpermute_rotary` undoes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

BLOCK = 32  # weights per quantization block, for both formats below


class WeightsError(ValueError):
    """A weights file that cannot be read as asked: the message names the file and the tensor or key."""


def _refuse(path: str | Path, what: str, expected: str, got: object) -> None:
    raise WeightsError(f"{path}: {what}: expected {expected}, got {got}")


def dequantize_q4_1(raw: np.ndarray) -> np.ndarray:
    """Q4_1 blocks (uint8 [n, 20]) -> float32 [n, 32]: weight = d * q + m, q in 0..15."""
    d = raw[:, 0:2].copy().view(np.float16).astype(np.float32)  # (n, 1) scale
    m = raw[:, 2:4].copy().view(np.float16).astype(np.float32)  # (n, 1) minimum
    qs = raw[:, 4:]  # (n, 16): weight j in the low nibble of byte j, weight j + 16 in its high nibble
    q = np.concatenate((qs & 0x0F, qs >> 4), axis=1).astype(np.float32)  # (n, 32)
    return d * q + m


def dequantize_q8_0(raw: np.ndarray) -> np.ndarray:
    """Q8_0 blocks (uint8 [n, 34]) -> float32 [n, 32]: weight = d * q, q a signed byte."""
    d = raw[:, 0:2].copy().view(np.float16).astype(np.float32)  # (n, 1) scale
    q = raw[:, 2:].copy().view(np.int8).astype(np.float32)  # (n, 32)
    return d * q


# GGML type id: (name, bytes per block of BLOCK weights, dequantizer); F32 is stored plainly.
FORMATS = {3: ("Q4_1", 20, dequantize_q4_1), 8: ("Q8_0", 34, dequantize_q8_0)}
F32 = 0


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor as the file stores it: its name, GGML type id, shape in PyTorch order, and raw bytes."""

    name: str
    type_id: int
    shape: tuple[int, ...]
    raw: np.ndarray

    @property
    def type_name(self) -> str:
        return "F32" if self.type_id == F32 else FORMATS.get(self.type_id, (f"type {self.type_id}",))[0]


def read_gguf(path: str | Path) -> tuple[dict[str, object], dict[str, GGUFTensor]]:
    """The metadata (key -> value; arrays as lists) and the tensors (name -> GGUFTensor) of a GGUF file.

    Raises WeightsError naming the file when it is missing or is not a readable GGUF file."""
    import gguf  # imported here: reading a file is the only use

    path = Path(path)
    if not path.is_file():
        _refuse(path, "file", "a GGUF file", "no such file")
    try:
        reader = gguf.GGUFReader(path)
        meta = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}
        tensors = {t.name: GGUFTensor(t.name, int(t.tensor_type), tuple(int(n) for n in reversed(t.shape)),
                                      np.asarray(t.data)) for t in reader.tensors}
    except (ValueError, OSError, IndexError, KeyError, TypeError) as e:
        raise WeightsError(f"{path}: file: expected a readable GGUF file, got {type(e).__name__}: {e}") from e
    return meta, tensors


def dequantize(tensor: GGUFTensor, path: str | Path = "<gguf>") -> np.ndarray:
    """The tensor's weights as float32, in its PyTorch shape (rows = output features)."""
    n = int(np.prod(tensor.shape))
    if tensor.type_id == F32:
        flat = tensor.raw.reshape(-1).view(np.float32) if tensor.raw.dtype == np.uint8 else tensor.raw.reshape(-1)
        if flat.size != n:
            _refuse(path, f"tensor {tensor.name}", f"{n} float32 values", flat.size)
        return np.array(flat, dtype=np.float32).reshape(tensor.shape)  # a copy: the file is mapped read-only
    if tensor.type_id not in FORMATS:
        _refuse(path, f"tensor {tensor.name}", f"one of F32, {', '.join(f[0] for f in FORMATS.values())}",
                tensor.type_name)
    _, block_bytes, fn = FORMATS[tensor.type_id]
    if n % BLOCK or tensor.raw.size != n // BLOCK * block_bytes:
        _refuse(path, f"tensor {tensor.name}", f"{n // BLOCK} blocks of {block_bytes} bytes for shape {tensor.shape}",
                f"{tensor.raw.size} bytes")
    return fn(tensor.raw.reshape(n // BLOCK, block_bytes)).reshape(tensor.shape)


def unpermute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo the row order GGUF writers give Q and K ([n_heads * D, C]).

    Within each head, the course (and Hugging Face) rotate channel i with channel i + D/2; llama.cpp
    rotates neighbours 2i and 2i + 1, so the writer interleaves the two halves of each head's rows.
    This puts them back: file row 2i -> row i, file row 2i + 1 -> row i + D/2."""
    rows, c = w.shape
    d = rows // n_heads
    return w.reshape(n_heads, d // 2, 2, c).swapaxes(1, 2).reshape(rows, c)
