"""The three ways the course holds a cache, and the one cache object each becomes.

Introduced in chapter 4. The model's `forward` turns whatever the caller holds into one
`KVCache` with `as_cache`; `Request` is the same three styles seen from the caller's side:
one request continued chunk by chunk, whatever style holds it.
"""

from __future__ import annotations

import torch

from labcode.caches.base import KVCache, snapshot
from labcode.caches.explicit import PairsCache
from labcode.caches.naive import ModuleStateCache, naive_state
from labcode.checks import fail

STYLES = ("naive", "explicit", "object")


def as_cache(model, cache=None, return_cache: bool = False, use_cache: bool = False) -> KVCache | None:
    """The one cache object behind `model(ids, cache, return_cache, use_cache=...)`, or None for the full pass.

    A KVCache is used as it is (chapters 3, 5); a list of (K, V) pairs, or return_cache=True,
    is wrapped in a PairsCache (chapter 4); use_cache=True views the state in the model (chapter 3).
    """
    explicit = return_cache or isinstance(cache, (list, tuple))
    if use_cache:
        if explicit or cache is not None:
            fail("cache, return_cache", "None and False when use_cache=True (the state lives in the model)",
                 f"{type(cache).__name__} and {return_cache}")
        return ModuleStateCache(model)
    if explicit:
        return PairsCache(model.cfg.kv_layers, cache)
    return cache  # a KVCache, or None (the model checks which)


class Request:
    """One request continued chunk by chunk in one of the three styles: `request(ids)` -> logits [B, T, V].

    "naive": the state lives in the model (use_cache=True; the model is reset first, as a new
    request needs); "explicit": a list of (K, V) pairs handed in and out (return_cache=True);
    "object": the KVCache `cache`, passed to every call.
    """

    def __init__(self, model, style: str, cache: KVCache | None = None) -> None:
        if style not in STYLES:
            fail("style", f"one of {STYLES}", repr(style))
        if (cache is not None) != (style == "object"):
            fail("cache", "a KVCache for style 'object', and None otherwise", type(cache).__name__)
        self.model, self.style, self.cache, self.pairs = model, style, cache, None
        if style == "naive":
            model.reset_kv_cache()

    def __call__(self, ids: torch.Tensor, model=None) -> torch.Tensor:
        """Continue the request with ids [B, T] (through `model`, another model holding the same weights, if given)."""
        model = model or self.model
        if self.style == "naive":
            return model(ids, use_cache=True)
        if self.style == "explicit":
            logits, self.pairs = model(ids, self.pairs, return_cache=True)
            return logits
        return model(ids, self.cache)

    @property
    def view(self) -> KVCache:
        """The request's state as a cache object: its position, lengths and stored keys."""
        if self.style == "naive":
            return ModuleStateCache(self.model)
        if self.style == "explicit":
            return PairsCache(self.model.cfg.kv_layers, self.pairs)
        return self.cache

    def state(self) -> object:
        """A snapshot of the request's state (tensors cloned), for "state unchanged" checks."""
        if self.style == "naive":
            return naive_state(self.model)
        if self.style == "explicit":
            return snapshot(self.pairs)
        return self.cache.state()
