"""`prefix`: llm-d's default scheduling profile with its "approximate" prefix-cache scorer.

Each backend with room gets a weighted sum of three scores in [0, 1] and the highest wins,
as llm-d's endpoint picker scores its candidates (Gateway API Inference Extension,
`config/charts/inferencepool/templates/epp-config.yaml`, default profile: queue-scorer 2,
kv-cache-utilization-scorer 2, prefix-cache-scorer 3; the scorers in
`pkg/epp/scheduling/framework/plugins/`):

- prefix: matched blocks / prompt blocks, the match read from this router's LRU index of
  what it sent where (`PrefixRouter`), the prompt cut at `max_prefix_blocks` (llm-d: 256);
- queue: (max − q) / (max − min) over the candidates' engine queues q (vLLM's waiting count;
  the gateway's in flight when unknown), 1 for all when they are equal;
- kv: 1 − KV usage (1 when unknown).

llm-d breaks equal scores at random; here the lower in-flight/cap wins, then the earlier
backend, so decisions are reproducible and still spread an empty index.
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
class LlmdPrefix(PrefixRouter):
    name = "prefix"
    description = "llm-d's default profile: prefix-match 3, queue 2, KV usage 2 (approximate)"
    prefix_weight: float = param(3.0, "weight of the prefix-match fraction (llm-d: 3)")
    queue_weight: float = param(2.0, "weight of the min-max engine queue score (llm-d: 2)")
    kv_weight: float = param(2.0, "weight of 1 − KV usage (llm-d: 2)")
    max_prefix_blocks: int = param(256, "prompt blocks matched at most (llm-d: 256)")

    def pick(self, job: Job, backends: Sequence[BackendState]) -> BackendState | None:
        candidates = open_backends(backends)
        if len(candidates) <= 1:
            return candidates[0] if candidates else None
        prefix = job.prefix[: self.max_prefix_blocks]
        total = len(prefix)
        queues = [b.inflight if b.waiting is None else b.waiting for b in candidates]
        lo, hi = min(queues), max(queues)
        best, best_key = candidates[0], (-1.0, 0.0)
        for b, q in zip(candidates, queues, strict=True):
            score = self.kv_weight * (1.0 - (b.kv_usage or 0.0))
            score += self.queue_weight * (1.0 if hi == lo else (hi - q) / (hi - lo))
            if total:  # the match of the cut prompt (remembered for on_route and reason)
                matched = min(self.cached_blocks(job, b), self.max_prefix_blocks)
                score += self.prefix_weight * matched / total
            key = (score, -b.load)
            if key > best_key:
                best, best_key = b, key
        return best
