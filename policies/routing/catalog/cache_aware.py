"""`cache-aware`: SGLang router's `cache_aware` policy.

From `sgl-router/src/policies/cache_aware.rs` with the launcher's defaults
(`sgl-router/py_src/sglang_router/router_args.py`: cache_threshold 0.3,
balance_abs_threshold 64, balance_rel_threshold 1.5):

1. Load is each backend's in-flight count. The fleet is imbalanced when
   max − min > `balance_abs_threshold` and max > `balance_rel_threshold` × min (over the
   backends serving the model); then the least-loaded backend with room wins.
2. Otherwise the backend with the longest cached prefix (this router's per-backend index of
   what it sent, standing in for SGLang's radix tree) wins if its match covers more than
   `cache_threshold` of the prompt; below that, the backend whose index is smallest (SGLang's
   "smallest tree": the most cache room).

Differences, by the contract: only backends with room are candidates (SGLang picks among
healthy workers and has no cap); matches count blocks, not characters; the index is
bounded by the backend's KV, not by SGLang's periodic `max_tree_size` eviction. Ties go to
the lower load, then the earlier backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from policies.base import param
from policies.job import Job
from policies.routing.base import BackendState, PrefixRouter, open_backends
from policies.routing.registry import register_router


@register_router
@dataclass(eq=False)
class CacheAware(PrefixRouter):
    name = "cache-aware"
    description = "SGLang's rule: longest cached prefix unless load is imbalanced, then least"
    cache_threshold: float = param(0.3, "least matched fraction that routes by cache (SGLang 0.3)")
    balance_abs_threshold: int = param(64, "imbalance: max − min in flight above this (64)")
    balance_rel_threshold: float = param(1.5, "imbalance: and max above this × min (1.5)")

    def pick(self, job: Job, backends: Sequence[BackendState]) -> BackendState | None:
        candidates = open_backends(backends)
        if len(candidates) <= 1:
            return candidates[0] if candidates else None
        if self.imbalanced(backends):
            return min(candidates, key=lambda b: b.inflight)
        if job.prefix:
            best = max(candidates, key=lambda b: (self.cached_blocks(job, b), -b.inflight))
            if self.cached_blocks(job, best) / len(job.prefix) > self.cache_threshold:
                return best
        return min(candidates, key=lambda b: (self.index_size(b), b.inflight))

    def imbalanced(self, backends: Sequence[BackendState]) -> bool:
        """SGLang's test: both the absolute and the relative load gap pass their thresholds."""
        loads = [b.inflight for b in backends if b.serving]
        hi, lo = max(loads), min(loads)
        return hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo
