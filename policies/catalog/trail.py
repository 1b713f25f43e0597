"""TRAIL-style shortest predicted remaining first with limited preemption.

The remaining-length estimate is refined as tokens are generated (the predicted distribution
conditioned on the tokens so far; its median minus what exists). A running job may be
preempted only while it is in the first `preempt_fraction` of its predicted length, so jobs
near completion are never thrown back (the trade-off TRAIL makes against recompute waste).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from policies.base import Key, Policy, param
from policies.job import Job
from policies.registry import register_policy


@register_policy
@dataclass(eq=False)
class Trail(Policy):
    name = "trail"
    description = (
        "Shortest predicted remaining first, refined as tokens stream; early preemption only."
    )
    needs_prediction = True
    preemptive: bool = param(True, "allow preemption within the first preempt_fraction")
    preempt_fraction: float = param(
        0.5, "share of the predicted length during which preemption is allowed"
    )

    def key(self, job: Job, now: float) -> Key:
        return (job.remaining_dist().quantile(0.5) - job.generated,)

    def next_review(self, job: Job) -> int | None:
        assert job.dist is not None
        support = job.dist.support
        i = int(np.searchsorted(support, job.generated, side="right"))
        points = [math.ceil(support[i])] if i < support.size else []
        limit = self._preempt_limit(job)
        if job.generated < limit:
            points.append(math.ceil(limit))
        return min(points) if points else None

    def can_be_preempted(self, job: Job) -> bool:
        return self.preemptive and job.generated < self._preempt_limit(job)

    def _preempt_limit(self, job: Job) -> float:
        return self.preempt_fraction * job.predicted_tokens()
