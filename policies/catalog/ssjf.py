"""Speculative shortest job first (SSJF): one point prediction, no preemption."""

from __future__ import annotations

from dataclasses import dataclass

from policies.base import Key, Policy
from policies.job import Job
from policies.registry import register_policy


@register_policy
@dataclass(eq=False)
class SSJF(Policy):
    name = "ssjf"
    description = "Shortest predicted output first (point prediction = median); non-preemptive."
    needs_prediction = True

    def key(self, job: Job, now: float) -> Key:
        return (job.predicted_tokens(),)
