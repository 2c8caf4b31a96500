"""Shipping a cache: one process prefills, serialises its cache, and another continues decoding from it.

Introduced in chapter 10. The bytes on the wire are a frame:

    b"KVCV" | format version (2 bytes) | header length (4 bytes) | JSON header | payload

The payload is every layer's keys then values, raw, in the cache's dtype: rows [B, Hkv, S, D] for a
contiguous or window cache, whole blocks [n, Hkv, block size, D] (in block-table order) for a paged
one. The header says what the payload is (kind, dtype, shapes, length, position), which model made it
(a fingerprint of its configuration and weights), and carries a SHA-256 checksum of the header's other
fields and the payload. The receiver checks everything before it writes anything, so a corrupted or
truncated transfer, a dtype mismatch and a cache from another model are each refused with a clear
`TransferError`, and the receiving cache is left exactly as it was.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import sys
from dataclasses import asdict

import torch
import torch.distributed as dist

from labcode.caches.base import KVCache, check_cache
from labcode.caches.concat import ConcatCache
from labcode.caches.growable import GrowableCache
from labcode.caches.prealloc import PreallocatedCache
from labcode.caches.ring import RingCache
from labcode.caches.window import WindowCache
from labcode.checks import fail
from labcode.cost import kv_cache_bytes
from labcode.engines.paged import PagedCache
from labcode.model import GPT
from labcode.roofline import element_bytes

MAGIC = b"KVCV"
VERSION = 1
PREFIX = struct.Struct(">4sHI")  # magic, format version, header length: 10 bytes, big-endian
FIELDS = {  # every header field but the checksum, and its JSON type
    "kind": str, "dtype": str, "byteorder": str, "fingerprint": str, "layers": int, "batch": int,
    "kv_heads": int, "head_dim": int, "length": int, "position": int, "block_size": (int, type(None)),
    "blocks": (int, type(None)), "payload_bytes": int,
}
KINDS = ("contiguous", "window", "paged")


class TransferError(ValueError):
    """A transfer the receiver refuses; raised before the receiving cache changes."""


def _refuse(argument: str, expected: str, got: object) -> None:
    fail(argument, expected, got, TransferError)


def fingerprint(model: GPT) -> str:
    """SHA-256 of a model's configuration and weights (as float64, so a model and its cast to another
    dtype share it: a dtype mismatch is reported as one, not as another model)."""
    h = hashlib.sha256(json.dumps(asdict(model.cfg), sort_keys=True).encode())
    for name, tensor in model.state_dict().items():
        h.update(name.encode())
        h.update(str(tuple(tensor.shape)).encode())
        h.update(tensor.detach().to("cpu", torch.float64).contiguous().numpy().tobytes())
    return h.hexdigest()


def payload_bytes(n_layers: int, batch: int, tokens: int, n_kv_heads: int, head_dim: int,
                  bytes_per_element: int) -> int:
    """Payload bytes of a transfer: 2 (K and V) * L * B * T * Hkv * D * bytes per element.

    T counts the token slots shipped: the rows held, or for a paged cache its blocks times the block size.
    """
    return kv_cache_bytes(n_layers, batch, tokens, n_kv_heads, head_dim, bytes_per_element)


def _canonical(fields: dict) -> bytes:
    return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


def frame(fields: dict, payload: bytes) -> bytes:
    """The transfer's bytes: prefix, JSON header (the fields and a checksum of them and the payload), payload."""
    checksum = hashlib.sha256(_canonical(fields) + payload).hexdigest()
    header = _canonical({**fields, "checksum": checksum})
    return PREFIX.pack(MAGIC, VERSION, len(header)) + header + payload


def read_frame(blob: bytes) -> tuple[dict, bytes]:
    """The header fields and the payload of a transfer, once its framing, lengths and checksum hold."""
    if not isinstance(blob, (bytes, bytearray)):
        _refuse("blob", "bytes", type(blob).__name__)
    if len(blob) < PREFIX.size:
        _refuse("blob", f"at least the {PREFIX.size}-byte prefix", f"{len(blob)} bytes (a truncated transfer)")
    magic, version, header_len = PREFIX.unpack_from(blob)
    if magic != MAGIC:
        _refuse("blob", f"a KV transfer starting with {MAGIC!r}", f"{magic!r} (not a transfer, or corrupted)")
    if version != VERSION:
        _refuse("version", f"transfer format {VERSION}", version)
    end = PREFIX.size + header_len
    if len(blob) < end:
        _refuse("blob", f"a {header_len}-byte header", f"{len(blob) - PREFIX.size} bytes (a truncated transfer)")
    try:
        fields = json.loads(bytes(blob[PREFIX.size:end]).decode())
    except (UnicodeDecodeError, json.JSONDecodeError):
        _refuse("header", "a JSON object", "bytes that do not parse (a corrupted transfer)")
    if not isinstance(fields, dict):
        _refuse("header", "a JSON object", type(fields).__name__)
    checksum = fields.pop("checksum", None)
    missing = sorted(set(FIELDS) - set(fields))
    wrong = sorted(k for k, kind in FIELDS.items() if k in fields and not isinstance(fields[k], kind))
    if missing or wrong or set(fields) - set(FIELDS) or not isinstance(checksum, str):
        _refuse("header", f"the fields {sorted(FIELDS)} and a checksum",
                f"missing {missing}, wrongly typed {wrong} (a corrupted transfer)")
    payload = bytes(blob[end:])
    if len(payload) != fields["payload_bytes"]:
        _refuse("blob", f"{fields['payload_bytes']} payload bytes after the header",
                f"{len(payload)} (a truncated transfer)")
    actual = hashlib.sha256(_canonical(fields) + payload).hexdigest()
    if actual != checksum:
        _refuse("checksum", f"sha256 {checksum[:12]}... (the sender's)", f"{actual[:12]}... (a corrupted transfer)")
    return fields, payload


def kind_of(cache: KVCache) -> str:
    """"paged", "window" or "contiguous": how a cache of the course is shipped."""
    if isinstance(cache, PagedCache):
        return "paged"
    if isinstance(cache, WindowCache):
        return "window"
    if isinstance(cache, (ConcatCache, PreallocatedCache)):
        return "contiguous"
    _refuse("cache", "a contiguous (ConcatCache, PreallocatedCache), window or paged cache", type(cache).__name__)


def _raw(t: torch.Tensor) -> bytes:
    return t.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def pack(cache: KVCache, model: GPT) -> bytes:
    """Serialise `cache`, filled by `model`, into a transfer (see the module docstring)."""
    kind = kind_of(cache)
    check_cache(cache, model.cfg.n_layers)
    if cache.chunk is not None:
        _refuse("cache", "no pass in progress", f"a pass begun at position {cache.chunk.start}")
    if cache.position == 0 or cache.layout is None:
        _refuse("cache", "a cache holding at least one position", "an empty one")
    layout = cache.layout
    block_size = blocks = None
    parts = []
    if kind == "paged":
        pool, table = cache.pool, cache.table
        block_size, blocks, length = pool.block_size, len(table), cache.position
        index = torch.tensor(table, device=pool.k[0].device)
        for layer in range(cache.n_layers):  # whole blocks, in the order of the block table
            parts += [_raw(pool.k[layer][index]), _raw(pool.v[layer][index])]  # (n, Hkv, bs, D) each
    else:
        length = cache.length()
        for layer in range(cache.n_layers):
            k, v = cache.read(layer)  # (B, Hkv, S, D), oldest position first
            parts += [_raw(k), _raw(v)]
    payload = b"".join(parts)
    fields = {
        "kind": kind, "dtype": str(layout.dtype).removeprefix("torch."), "byteorder": sys.byteorder,
        "fingerprint": fingerprint(model), "layers": cache.n_layers, "batch": layout.batch,
        "kv_heads": layout.kv_heads, "head_dim": layout.head_dim, "length": length, "position": cache.position,
        "block_size": block_size, "blocks": blocks, "payload_bytes": len(payload),
    }
    return frame(fields, payload)


def _rows(fields: dict, payload: bytes, dtype: torch.dtype, device: torch.device) -> list[tuple]:
    """Every layer's (K, V) [B, Hkv, S, D] from the payload: copies, on `device`."""
    b, hkv, d, s = fields["batch"], fields["kv_heads"], fields["head_dim"], fields["length"]
    flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype)
    if fields["kind"] == "paged":
        n, bs = fields["blocks"], fields["block_size"]
        per = flat.view(fields["layers"], 2, n, hkv, bs, d)  # whole blocks, in table order
        as_rows = per.permute(0, 1, 3, 2, 4, 5).reshape(fields["layers"], 2, 1, hkv, n * bs, d)[..., :s, :]
    else:
        as_rows = flat.view(fields["layers"], 2, b, hkv, s, d)
    as_rows = as_rows.to(device)
    return [(as_rows[layer, 0].contiguous(), as_rows[layer, 1].contiguous()) for layer in range(fields["layers"])]


def unpack(blob: bytes, model: GPT, into: KVCache) -> dict:
    """Fill the empty cache `into` from a transfer made for `model`; return the transfer's header fields.

    Checks, in order, before writing anything: the framing, lengths and checksum (a corrupted or
    truncated transfer), the dtype and byte order, the model's fingerprint and shapes, and that `into`
    is empty and can take the rows (a cache that dropped rows continues only in a WindowCache).
    Raises TransferError (or the receiving cache's CacheError) and leaves `into` unchanged.
    """
    fields, payload = read_frame(blob)
    if fields["kind"] not in KINDS:
        _refuse("kind", f"one of {list(KINDS)}", repr(fields["kind"]))
    dtype = getattr(torch, fields["dtype"], None)
    if dtype != model.dtype:
        _refuse("dtype", f"{model.dtype} (the receiving model's)", f"a cache of {fields['dtype']}")
    if fields["byteorder"] != sys.byteorder:
        _refuse("byteorder", f"{sys.byteorder}-endian (this machine's)", fields["byteorder"])
    ours = fingerprint(model)
    if fields["fingerprint"] != ours:
        _refuse("model", f"a cache made by this model (fingerprint {ours[:12]})",
                f"one made by {fields['fingerprint'][:12]} (another model, or other weights)")
    cfg = model.cfg
    shape = (fields["layers"], fields["kv_heads"], fields["head_dim"])
    if shape != (cfg.n_layers, cfg.n_kv_heads, cfg.head_dim):
        _refuse("header", f"(L, Hkv, D) = {(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim)}", shape)
    s, position = fields["length"], fields["position"]
    slots = s if fields["kind"] != "paged" else fields["blocks"] * fields["block_size"]
    expected = payload_bytes(fields["layers"], fields["batch"], slots, fields["kv_heads"], fields["head_dim"],
                             element_bytes(dtype))
    if not (0 < s <= position and (s == position or fields["kind"] == "window") and expected == len(payload)):
        _refuse("header", "a length, position and payload that agree", (s, position, len(payload)))
    check_cache(into, cfg.n_layers)
    if into.chunk is not None or into.position != 0 or into.length() != 0:
        _refuse("into", "an empty cache between passes", f"one at position {into.position}")
    if position > s and not (isinstance(into, WindowCache) and not isinstance(into, RingCache)):
        _refuse("into", "a WindowCache (the sender dropped positions; only a window can continue from them)",
                type(into).__name__)
    room = into.room()
    if isinstance(into, PreallocatedCache) and not isinstance(into, (WindowCache, GrowableCache)):
        room = into.capacity  # fixed buffers: no more rows than slots
    if room is not None and s > room:
        _refuse("into", f"room for the {s} positions shipped", f"room for {room}")
    into.check((fields["batch"], fields["kv_heads"], s, fields["head_dim"]), dtype, model.device)
    rows = _rows(fields, payload, dtype, model.device)
    into.begin((fields["batch"], fields["kv_heads"], s, fields["head_dim"]), dtype, model.device)
    try:
        for layer, (k, v) in enumerate(rows):
            into.append(layer, k, v)
    except BaseException:
        into.cancel()
        raise
    into.end()
    if position > s:  # the sender's window dropped its oldest positions: the next token is still at `position`
        into.total_dropped += position - s
        into.position = position
    return fields


def without_digests(message: str) -> str:
    """An error message with its SHA-256 digests shown as <sha256>: a checksum covers float bytes whose
    last digits differ between CPUs, and a page must read the same on every machine."""
    return re.sub(r"\b[0-9a-f]{12}\b", "<sha256>", message)


def send_bytes(blob: bytes, dst: int, group=None) -> None:
    """Send a byte string to rank `dst`: its length, then its bytes."""
    dist.send(torch.tensor([len(blob)], dtype=torch.int64), dst, group=group)
    dist.send(torch.frombuffer(bytearray(blob), dtype=torch.uint8), dst, group=group)


def recv_bytes(src: int, group=None) -> bytes:
    """Receive a byte string sent by `send_bytes` from rank `src`."""
    n = torch.empty(1, dtype=torch.int64)
    dist.recv(n, src, group=group)
    buf = torch.empty(int(n), dtype=torch.uint8)
    dist.recv(buf, src, group=group)
    return buf.numpy().tobytes()
