"""Learning-to-rank style ordering (after Fu et al., NeurIPS 2024) with a starvation guard.

The score is the expected log output length under the predicted distribution: ordering by it
is ordering by predicted rank, and unlike the median it moves smoothly with the whole shape.
A job that has waited `starvation_s` is promoted ahead of every unpromoted job (promoted jobs
keep arrival order), so no job waits forever behind a stream of short ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from policies.base import Key, Policy, param
from policies.job import Job
from policies.registry import register_policy


@register_policy
@dataclass(eq=False)
class LearningToRank(Policy):
    name = "ltr"
    description = "Order by predicted length rank (E[log length]); promote jobs starved too long."
    needs_prediction = True
    starvation_s: float = param(30.0, "waiting time after which a job is promoted (seconds)")

    def key(self, job: Job, now: float) -> Key:
        if now - job.arrival_s >= self.starvation_s:
            return (0.0, job.arrival_s)
        dist = job.remaining_dist()
        return (1.0, float(np.log(dist.support) @ dist.probs))

    def review_at(self, job: Job) -> float | None:
        return job.arrival_s + self.starvation_s
