"""KIVI-style low-bit K/V: keys quantised per channel, values per token, the latest tokens kept exact.

Introduced in the chapter on smaller caches (after chapter 9's int8 `QuantizedCache`). Keys have
outlier channels, large in every token, so KIVI quantises each key channel over a group of G
tokens (one scale and zero point per channel and group); values have no such channels and are
quantised per token (one scale and zero point per token, or per group of channels). Both are
asymmetric: codes = round((x - min) / scale), scale = (max - min) / (2^bits - 1), so 2 bits give
four levels between the group's min and max. Codes are packed 8 / bits to a byte.

The latest R tokens are kept in full precision (the residual): a token is quantised, with its group,
once the whole group is older than the latest R. So when a token is quantised depends only on how many
tokens the cache holds, and the T new tokens of a pass always attend to themselves in full precision.
This is one rule for keys and values alike; KIVI's reference code quantises its exact keys R at a time
and slides its exact values one token at a time (the chapter compares them).
"""

from __future__ import annotations

import torch

from labcode.caches.base import CacheError, Chunk, KVCache
from labcode.checks import fail, is_int
from labcode.engines.quant import pack, unpack

BITS = (2, 4, 8)


def quantize_asym(x: torch.Tensor, dim: int, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric codes of x over `dim`: (codes uint8 like x, scale, zero) with scale and zero reduced on dim."""
    lo, hi = x.amin(dim=dim, keepdim=True), x.amax(dim=dim, keepdim=True)
    scale = (hi - lo) / (2**bits - 1)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant group: codes 0, back to lo exactly
    codes = torch.round((x - lo) / safe).clamp(0, 2**bits - 1).to(torch.uint8)
    return codes, scale, lo


def quantize_keys(k: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys [B, Hkv, S, D] (S a multiple of G) per channel over groups of G tokens -> (packed codes
    [B, Hkv, S, D * bits / 8], scales and zero points [B, Hkv, S / G, D])."""
    b, hkv, s, d = k.shape
    codes, scale, zero = quantize_asym(k.reshape(b, hkv, s // group_size, group_size, d), 3, bits)
    return pack(codes.reshape(b, hkv, s, d), bits), scale.squeeze(3), zero.squeeze(3)


def quantize_values(v: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Values [B, Hkv, S, D] per token over groups of g channels -> (packed codes [B, Hkv, S, D * bits / 8],
    scales and zero points [B, Hkv, S, D / g])."""
    b, hkv, s, d = v.shape
    codes, scale, zero = quantize_asym(v.reshape(b, hkv, s, d // group_size, group_size), 4, bits)
    return pack(codes.reshape(b, hkv, s, d), bits), scale.squeeze(4), zero.squeeze(4)


def dequantize_keys(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                    group_size: int) -> torch.Tensor:
    """Inverse of `quantize_keys`, up to rounding: [B, Hkv, S, D] in the dtype of the scales."""
    codes = unpack(packed, bits)
    b, hkv, s, d = codes.shape
    g = group_size
    x = codes.view(b, hkv, s // g, g, d).to(scale.dtype) * scale.unsqueeze(3) + zero.unsqueeze(3)
    return x.reshape(b, hkv, s, d)


def dequantize_values(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `quantize_values`, up to rounding: [B, Hkv, S, D] in the dtype of the scales."""
    codes = unpack(packed, bits)
    b, hkv, s, d = codes.shape
    g = d // scale.shape[3]
    x = codes.view(b, hkv, s, d // g, g).to(scale.dtype) * scale.unsqueeze(4) + zero.unsqueeze(4)
    return x.reshape(b, hkv, s, d)


def quantized_tokens(tokens: int, group_size: int, residual: int) -> int:
    """How many of `tokens` held tokens are quantised: the whole groups of G older than the latest R."""
    return group_size * (max(0, tokens - residual) // group_size)


def kivi_bytes(n_layers: int, n_kv_heads: int, head_dim: int, tokens: int, bits: int, group_size: int,
               residual: int, value_group: int | None = None, scale_bytes: int = 2, residual_bytes: int = 2) -> int:
    """Bytes a KIVI cache takes for `tokens` tokens of one sequence: packed codes, a scale and a zero point per
    key channel and group of G tokens and per value token (and channel group), and the residual in full
    precision (`residual_bytes` an element; scales and zero points `scale_bytes` each, fp16 by default)."""
    d, gv = head_dim, head_dim if value_group is None else value_group
    q = quantized_tokens(tokens, group_size, residual)
    codes = 2 * q * d * bits // 8
    scales = 2 * scale_bytes * (q // group_size * d + q * (d // gv))  # scale and zero point, keys then values
    exact = 2 * (tokens - q) * d * residual_bytes
    return n_layers * n_kv_heads * (codes + scales + exact)


class KIVICache(KVCache):
    """Keys per channel and values per token in `bits` bits (2, 4 or 8), the latest `residual` tokens exact.

    Each layer holds a dict of tensors: packed codes, scales and zero points of the quantised tokens
    (the oldest, in whole groups of `group_size`), and the residual K, V [B, Hkv, R', D] after them.
    What attention reads is the dequantised tokens followed by the exact ones.
    """

    def __init__(self, n_layers: int, bits: int = 2, group_size: int = 32, residual: int = 32,
                 value_group: int | None = None) -> None:
        super().__init__(n_layers)
        if not (is_int(bits) and bits in BITS):
            fail("bits", f"one of {BITS}", repr(bits), CacheError)
        if not (is_int(group_size) and group_size > 0):
            fail("group_size", "a positive number of tokens per key group", repr(group_size), CacheError)
        if not (is_int(residual) and residual >= 0):
            fail("residual", "a number of latest tokens kept exact, at least 0", repr(residual), CacheError)
        if not (value_group is None or (is_int(value_group) and value_group > 0)):
            fail("value_group", "None or a positive number of channels per value group", repr(value_group),
                 CacheError)
        self.bits, self.group_size, self.residual, self.value_group = bits, group_size, residual, value_group
        self.store: list[dict | None] = [None] * n_layers

    def _check(self, chunk: Chunk) -> None:
        """The format needs the head dim D: codes pack 8 / bits to a byte, value groups divide D."""
        d = chunk.shape[3]
        if d % (8 // self.bits):
            fail("k, v", f"a head dim that is a multiple of {8 // self.bits} (codes of {self.bits} bits pack "
                 "into bytes)", d, CacheError)
        if self.value_group is not None and d % self.value_group:
            fail("value_group", f"a divisor of the head dim D={d}", self.value_group, CacheError)

    def _open(self, chunk: Chunk) -> None:
        super()._open(chunk)
        chunk.plan = [None] * self.n_layers  # each layer's new k, v: kept in full precision until the commit

    def _append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.chunk.plan[layer] = (k, v)
        if self.store[layer] is None:
            return k, v
        old_k, old_v = self._read(layer)
        return torch.cat((old_k, k), dim=2), torch.cat((old_v, v), dim=2)  # (B, Hkv, S + T, D)

    def _commit(self, chunk: Chunk) -> None:
        """The new tokens join the residual; the groups now older than the latest R are quantised."""
        for layer, (k, v) in enumerate(chunk.plan):
            s = self.store[layer] or self._empty(k)
            k_res, v_res = torch.cat((s["k_res"], k), dim=2), torch.cat((s["v_res"], v), dim=2)
            n = quantized_tokens(k_res.shape[2], self.group_size, self.residual)  # residual rows to quantise
            if n:
                g = k.shape[3] if self.value_group is None else self.value_group
                new = (*quantize_keys(k_res[:, :, :n], self.bits, self.group_size),
                       *quantize_values(v_res[:, :, :n], self.bits, g))
                for name, t in zip(("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero"), new,
                                   strict=True):
                    s[name] = torch.cat((s[name], t), dim=2)
            s["k_res"], s["v_res"] = (k_res[:, :, n:].clone(), v_res[:, :, n:].clone()) if n else (k_res, v_res)
            self.store[layer] = s
        super()._commit(chunk)

    def _empty(self, k: torch.Tensor) -> dict:
        """A layer's store with nothing in it, in the shapes and dtypes of k [B, Hkv, T, D]."""
        b, hkv, _, d = k.shape
        gv = d if self.value_group is None else self.value_group
        codes = k.new_zeros(b, hkv, 0, d * self.bits // 8, dtype=torch.uint8)
        return {"k_codes": codes, "k_scale": k.new_zeros(b, hkv, 0, d), "k_zero": k.new_zeros(b, hkv, 0, d),
                "v_codes": codes.clone(), "v_scale": k.new_zeros(b, hkv, 0, d // gv),
                "v_zero": k.new_zeros(b, hkv, 0, d // gv), "k_res": k[:, :, :0], "v_res": k[:, :, :0]}

    def _read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.store[layer]
        k = dequantize_keys(s["k_codes"], s["k_scale"], s["k_zero"], self.bits, self.group_size)
        v = dequantize_values(s["v_codes"], s["v_scale"], s["v_zero"], self.bits)
        return torch.cat((k, s["k_res"]), dim=2), torch.cat((v, s["v_res"]), dim=2)  # (B, Hkv, S, D)

    def quantized(self, layer: int = 0) -> int:
        """How many of `layer`'s tokens are held as codes (the rest are the exact residual)."""
        return 0 if self.store[layer] is None else self.store[layer]["k_codes"].shape[2]

    def length(self, layer: int = 0) -> int:
        return 0 if self.store[layer] is None else self.quantized(layer) + self.store[layer]["k_res"].shape[2]

    def read(self, layer: int = 0) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """What attention reads: the dequantised tokens, then the exact residual, K and V [B, Hkv, S, D]."""
        return (None, None) if self.store[layer] is None else self._read(layer)

    def rollback_limit(self) -> int:
        """Every position while nothing is quantised; after that only residual rows beyond the latest R, since
        a rollback into them would need tokens back in full precision that are now codes."""
        if self.quantized() == 0:
            return self.position
        return self.length() - self.quantized() - self.residual

    def _rollback(self, n: int) -> None:
        for s in self.store:
            s["k_res"], s["v_res"] = s["k_res"][:, :, : -n], s["v_res"][:, :, : -n]

    def _reorder(self, index: torch.Tensor) -> int:
        self.store = [{name: t.index_select(0, index.to(t.device)) for name, t in s.items()} for s in self.store]
        return self.nbytes

    def reset(self) -> None:
        super().reset()
        self.store = [None] * self.n_layers

    @property
    def nbytes(self) -> int:
        """Bytes held: packed codes, scales, zero points and the exact residual."""
        return sum(t.nbytes for s in self.store if s is not None for t in s.values())
