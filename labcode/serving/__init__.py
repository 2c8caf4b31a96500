"""Serving many requests: a continuous-batching scheduler over the paged pool, and prefix caches.

Introduced in chapter 11 (serving). Importing it does nothing.
"""

from labcode.serving.compare import compare_prefix_caches, distinct_prefixes, gaps_to_alone, summary
from labcode.serving.paged_batch import PagedBatch, run_paged_batch
from labcode.serving.prefix import HashPrefixCache, RadixPrefixCache, salted_hashes
from labcode.serving.scheduler import Scheduler, Seq, check_invariants, serve
from labcode.serving.trace import Request, few_shot_trace, multi_turn_trace, random_trace, system_prompt_trace

__all__ = [
    "HashPrefixCache",
    "PagedBatch",
    "RadixPrefixCache",
    "Request",
    "Scheduler",
    "Seq",
    "check_invariants",
    "compare_prefix_caches",
    "distinct_prefixes",
    "few_shot_trace",
    "gaps_to_alone",
    "multi_turn_trace",
    "random_trace",
    "run_paged_batch",
    "salted_hashes",
    "serve",
    "summary",
    "system_prompt_trace",
]
