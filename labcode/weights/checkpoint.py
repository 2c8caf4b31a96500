"""Saving and loading model weights with their config.

Introduced in chapter 1. Loading uses `torch.load(weights_only=True)`: the file
holds only tensors, numbers and strings, never pickled code.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch

from labcode.config import GPTConfig
from labcode.model import GPT

DEFAULT_CHECKPOINT = Path(__file__).parent.parent / "data" / "tiny.pt"
DRAFT_CHECKPOINT = DEFAULT_CHECKPOINT.with_name("draft.pt")  # the "draft" preset, trained the same way
# Chapter 13's variants of the tiny model with half its cache, trained the same way.
CLA_CHECKPOINT = DEFAULT_CHECKPOINT.with_name("tiny_cla.pt")  # cross-layer attention, kv_share=2
GQA_CHECKPOINT = DEFAULT_CHECKPOINT.with_name("tiny_gqa.pt")  # grouped-query, two key/value heads


def save_checkpoint(model: GPT, path: str | Path, meta: dict | None = None) -> None:
    """Write the model's config, weights and optional metadata to `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"config": asdict(model.cfg), "state_dict": model.state_dict(), "meta": dict(meta or {})}
    torch.save(payload, path)


def load_checkpoint(path: str | Path = DEFAULT_CHECKPOINT, device: str | torch.device | None = None,
                    dtype: torch.dtype = torch.float32) -> GPT:
    """A model in eval mode with the weights stored at `path` (the shipped tiny model by default)."""
    device = torch.device(device) if device is not None else default_device()
    payload = torch.load(Path(path), map_location="cpu", weights_only=True)
    model = GPT(GPTConfig(**payload["config"]))
    model.load_state_dict(payload["state_dict"])
    return model.to(device=device, dtype=dtype).eval()


def default_device() -> torch.device:
    """CUDA when present, CPU otherwise."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
