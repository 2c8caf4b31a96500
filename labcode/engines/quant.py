"""Quantised K/V: integer codes and a scale per token (or per group), optionally after a Hadamard rotation.

Introduced in chapter 9. Symmetric absmax quantisation: codes = round(x / scale) with
scale = max|x| / (2^(bits-1) - 1) over each token's head vector (or each group of it).
A Hadamard rotation H (orthonormal, H = H^T = H^-1) spreads an outlier channel over
every channel before rounding; since (qH)(kH)^T = q k^T, rotating back the dequantised
keys is the same as rotating the queries (llama.cpp rotates Q and K).
"""

from __future__ import annotations

import copy

import torch

from labcode.caches.base import CacheError, Chunk, KVCache
from labcode.checks import fail, is_int
from labcode.cost import codes_per_byte


def hadamard(n: int, dtype: torch.dtype = torch.float64, device: torch.device | str | None = None) -> torch.Tensor:
    """Orthonormal Walsh-Hadamard matrix [n, n] (Sylvester's construction); n must be a power of two."""
    if not (is_int(n) and n > 0 and n & (n - 1) == 0):
        fail("n", "a power of two", n, CacheError)
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), dim=1), torch.cat((h, -h), dim=1)), dim=0)  # [[H, H], [H, -H]]
    return (h / n**0.5).to(dtype=dtype, device=device)


def check_format(d: int, bits: int, group_size: int | None) -> int:
    """Raise CacheError unless `bits` is in [2, 8] and `group_size` divides the head dim D; return the group size."""
    if not (is_int(bits) and 2 <= bits <= 8):
        fail("bits", "an int in [2, 8]", bits, CacheError)
    g = d if group_size is None else group_size
    if not (is_int(g) and g > 0 and d % g == 0):
        fail("group_size", f"None or a positive divisor of D={d}", group_size, CacheError)
    return g


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes uint8 [..., D] in [0, 2^bits) -> bytes uint8 [..., D * bits / 8], 8 / bits codes to a byte."""
    per = 8 // bits
    groups = codes.reshape(*codes.shape[:-1], codes.shape[-1] // per, per)  # (..., D/per, per)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)  # (per,)
    return (groups << shifts).sum(dim=-1, dtype=torch.uint8)  # disjoint bits: the sum is an OR


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `pack`: bytes uint8 [..., D * bits / 8] -> codes uint8 [..., D]."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    codes = (packed.unsqueeze(-1) >> shifts) & (2**bits - 1)  # (..., D/per, per)
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * (8 // bits))


def quantize(x: torch.Tensor, bits: int = 8, group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (codes int8 [..., D], scales float32 [..., D / group_size]); one group = one token by default."""
    g = check_format(x.shape[-1], bits, group_size)
    qmax = 2 ** (bits - 1) - 1
    groups = x.reshape(*x.shape[:-1], x.shape[-1] // g, g).to(torch.float32)  # (..., D/g, g)
    scales = groups.abs().amax(dim=-1) / qmax  # (..., D/g)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero group keeps codes 0
    codes = torch.round(groups / safe.unsqueeze(-1)).clamp(-qmax, qmax).to(torch.int8)
    return codes.reshape(x.shape), scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `quantize`, up to rounding: [..., D] in `dtype`."""
    g = codes.shape[-1] // scales.shape[-1]
    groups = codes.reshape(*codes.shape[:-1], scales.shape[-1], g).to(torch.float32) * scales.unsqueeze(-1)
    return groups.reshape(codes.shape).to(dtype)


def fake_quantize(x: torch.Tensor, bits: int = 8, group_size: int | None = None,
                  rotate: bool = False) -> torch.Tensor:
    """What a quantised cache gives back for x [..., D]: dequantize(quantize(x H)) H^T, H = I unless `rotate`."""
    h = hadamard(x.shape[-1], x.dtype, x.device) if rotate else None
    y = x @ h if rotate else x
    y = dequantize(*quantize(y, bits, group_size), x.dtype)
    return y @ h.T if rotate else y


class QuantizedCache(KVCache):
    """Stores integer codes and float32 scales of K and V (after an optional Hadamard rotation), grown by
    concatenation. Codes of 2 or 4 bits are packed 8 / bits to a byte (the head dim must then be a multiple of
    8 / bits); codes of any other width take one byte each."""

    def __init__(self, n_layers: int, bits: int = 8, group_size: int | None = None, rotate: bool = False) -> None:
        super().__init__(n_layers)
        if not (is_int(bits) and 2 <= bits <= 8):
            fail("bits", "an int in [2, 8]", bits, CacheError)
        if not (group_size is None or (is_int(group_size) and group_size > 0)):
            fail("group_size", "None or a positive int", group_size, CacheError)
        self.bits, self.group_size, self.rotate = bits, group_size, rotate
        self.per_byte = codes_per_byte(bits)
        self.packed = self.per_byte > 1
        self.codes: list[list[torch.Tensor] | None] = [None] * n_layers  # [k_codes, k_scales, v_codes, v_scales]

    def _encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x @ hadamard(x.shape[-1], x.dtype, x.device) if self.rotate else x
        codes, scales = quantize(y, self.bits, self.group_size)
        if self.packed:  # codes in [-qmax, qmax] stored as code + 2^(bits-1), in [1, 2^bits)
            codes = pack((codes + 2 ** (self.bits - 1)).to(torch.uint8), self.bits)
        return codes, scales

    def _decode(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.packed:
            codes = unpack(codes, self.bits).to(torch.int8) - 2 ** (self.bits - 1)
        y = dequantize(codes, scales, dtype)
        return y @ hadamard(y.shape[-1], y.dtype, y.device).T if self.rotate else y

    def _check(self, chunk: Chunk) -> None:
        """The format needs the head dim D: checked once per pass, before any change."""
        d = chunk.shape[3]
        if self.rotate and d & (d - 1):
            fail("k", "a head dim that is a power of two (for the rotation)", d, CacheError)
        if d % self.per_byte:
            fail("k, v", f"a head dim that is a multiple of {self.per_byte} (codes of {self.bits} bits pack "
                 "into bytes)", d, CacheError)
        check_format(d, self.bits, self.group_size)

    def _append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        new = [*self._encode(k), *self._encode(v)]
        old = self.codes[layer]
        self.codes[layer] = new if old is None else [torch.cat((a, b), dim=2) for a, b in zip(old, new, strict=True)]
        return self._read(layer, k.dtype)  # (B, Hkv, S, D): every step dequantises all S

    def _read(self, layer: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        kc, ks, vc, vs = self.codes[layer]
        return self._decode(kc, ks, dtype), self._decode(vc, vs, dtype)

    def _rollback(self, n: int) -> None:
        """Narrow every layer's codes and scales to the first S - n tokens (each token is quantised alone)."""
        keep = self.length() - n
        self.codes = [[t[:, :, :keep] for t in c] for c in self.codes]

    def _reorder(self, index: torch.Tensor) -> int:
        self.codes = [[t.index_select(0, index.to(t.device)) for t in c] for c in self.codes]
        return sum(t.nbytes for c in self.codes for t in c)

    def length(self, layer: int = 0) -> int:
        return 0 if self.codes[layer] is None else self.codes[layer][0].shape[2]

    def read(self, layer: int = 0) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """What attention reads: the dequantised K, V [B, Hkv, S, D] (not the values first appended)."""
        return (None, None) if self.codes[layer] is None else self._read(layer, self.layout.dtype)

    def reset(self) -> None:
        super().reset()
        self.codes = [None] * self.n_layers

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for c in self.codes if c is not None for t in c)


def key_outlier_ratio(keys: torch.Tensor) -> float:
    """How far one channel of a layer's keys stands out: for each key/value head of keys [B, Hkv, S, D] (the first
    sequence), the root mean square of every channel over the S positions, the largest channel's over the median
    channel's (torch's median: the lower middle value when D is even); returned, the largest over the heads. About 1
    where no channel stands out."""
    if not (isinstance(keys, torch.Tensor) and keys.dim() == 4 and keys.shape[2] > 0 and keys.is_floating_point()):
        fail("keys", "a float tensor [B, Hkv, S, D] with S >= 1",
             tuple(keys.shape) if isinstance(keys, torch.Tensor) else type(keys).__name__, CacheError)
    rms = keys[0].pow(2).mean(1).sqrt()  # (Hkv, D)
    return (rms.max(-1).values / rms.median(-1).values).max().item()


def with_key_outliers(model, factor: float, channel: int = 0):
    """A copy of a learned-position `model` whose keys have an outlier `channel` in every head.

    Key channel c is multiplied by `factor` and query channel c divided by it, so every
    score q.k, hence every logit, is unchanged up to rounding; only the cached keys differ.
    """
    if model.cfg.rotary:
        fail("model", "learned positions (rotary mixes channel pairs)", "rotary=True", CacheError)
    if factor == 0:
        fail("factor", "a non-zero number", factor, CacheError)
    d, h, hkv = model.cfg.head_dim, model.cfg.n_heads, model.cfg.n_kv_heads
    if not (is_int(channel) and 0 <= channel < d):
        fail("channel", f"an int in [0, {d})", channel, CacheError)
    out = copy.deepcopy(model)
    with torch.no_grad():
        for block in out.blocks:
            attn = block.attn
            for head in range(hkv):  # kv_proj rows: K heads first, then V heads
                attn.kv_proj.weight[head * d + channel] *= factor
                attn.kv_proj.bias[head * d + channel] *= factor
            for head in range(h):
                attn.q_proj.weight[head * d + channel] /= factor
                attn.q_proj.bias[head * d + channel] /= factor
    return out
