"""Deadline-driven orders: earliest deadline first and least laxity first.

Jobs without a deadline sort after every job that has one (key +inf), in arrival order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from policies.base import Key, Policy, param
from policies.job import Job
from policies.registry import register_policy


@register_policy
@dataclass(eq=False)
class EDF(Policy):
    name = "edf"
    description = "Earliest SLO deadline first; jobs without a deadline go last."

    def key(self, job: Job, now: float) -> Key:
        return (math.inf if job.deadline_s is None else job.deadline_s,)


@register_policy
@dataclass(eq=False)
class LLF(Policy):
    """Laxity = deadline − now − estimated service. Every waiting job's laxity falls at the
    same rate, so ordering by `deadline − estimated service` is the same order at any time and
    the key never needs a review."""

    name = "llf"
    description = "Least laxity first: deadline minus now minus estimated service time."
    needs_prediction = True
    prompt_s_per_token: float = param(0.0005, "estimated seconds per prompt token")
    output_s_per_token: float = param(0.001, "estimated seconds per output token")

    def key(self, job: Job, now: float) -> Key:
        if job.deadline_s is None:
            return (math.inf,)
        service = (
            self.prompt_s_per_token * job.prompt_tokens
            + self.output_s_per_token * job.predicted_tokens()
        )
        return (job.deadline_s - service,)
