"""Cache policies, each a small class behind the one `KVCache` contract (chapters 3 to 6; smaller caches)."""

from labcode.caches.base import CacheError, KVCache, NoCache
from labcode.caches.concat import ConcatCache
from labcode.caches.explicit import PairsCache
from labcode.caches.growable import GrowableCache
from labcode.caches.latent import LatentCache
from labcode.caches.naive import ModuleStateCache
from labcode.caches.prealloc import PreallocatedCache
from labcode.caches.ring import RingCache
from labcode.caches.scored import H2OCache, SnapKVCache, StreamingCache
from labcode.caches.sinks import SinkCache
from labcode.caches.sliding import SlidingWindowCache
from labcode.caches.styles import Request, as_cache
from labcode.caches.window import WindowCache

__all__ = [
    "CacheError",
    "ConcatCache",
    "GrowableCache",
    "H2OCache",
    "KVCache",
    "LatentCache",
    "ModuleStateCache",
    "NoCache",
    "PairsCache",
    "PreallocatedCache",
    "Request",
    "RingCache",
    "SinkCache",
    "SlidingWindowCache",
    "SnapKVCache",
    "StreamingCache",
    "WindowCache",
    "as_cache",
]
