"""First come, first served: the order vLLM itself uses."""

from __future__ import annotations

from dataclasses import dataclass

from policies.base import Key, Policy
from policies.job import Job
from policies.registry import register_policy


@register_policy
@dataclass(eq=False)
class FCFS(Policy):
    name = "fcfs"
    description = "First come, first served (arrival order); the baseline vLLM applies itself."

    def key(self, job: Job, now: float) -> Key:
        return (job.arrival_s,)
