"""Estimated service time first, as in the portability study (REFERENCE.md §2)."""

from __future__ import annotations

from dataclasses import dataclass

from policies.base import Key, Policy, param
from policies.job import Job
from policies.registry import register_policy


@register_policy
@dataclass(eq=False)
class EstimatedServiceFirst(Policy):
    name = "est-first"
    description = "Shortest estimated service first: prompt_weight·prompt + predicted output."
    needs_prediction = True
    prompt_weight: float = param(0.5, "weight of a prompt token relative to an output token")

    def key(self, job: Job, now: float) -> Key:
        return (self.prompt_weight * job.prompt_tokens + job.predicted_tokens(),)
