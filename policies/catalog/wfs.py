"""Weighted fair share by tenant: start-time fair queuing over estimated job cost.

At admission a job gets a start tag S = max(V, F_tenant) and the tenant's finish tag becomes
F_tenant = S + cost / weight, where cost = prompt + predicted output tokens and V, the system
virtual time, is the start tag of the job most recently started. Jobs go in start-tag order.
Unlike VTC it charges predicted cost up front and its keys never change after admission.
"""

from __future__ import annotations

from dataclasses import dataclass

from policies.base import Key, Policy, param, state
from policies.job import Job
from policies.registry import register_policy


@register_policy
@dataclass(eq=False)
class WeightedFairShare(Policy):
    name = "wfs"
    description = "Weighted fair share by tenant (start-time fair queuing on predicted tokens)."
    needs_prediction = True
    tenant_weights: tuple[tuple[str, float], ...] = param((), "(tenant, weight) pairs; default 1")
    virtual_time: float = state(float)
    finish_tags: dict[str, float] = state(dict)
    start_tags: dict[int, float] = state(dict)

    def key(self, job: Job, now: float) -> Key:
        return (self.start_tags[job.id],)

    def on_admit(self, job: Job, now: float) -> None:
        weight = dict(self.tenant_weights).get(job.tenant, 1.0)
        start = max(self.virtual_time, self.finish_tags.get(job.tenant, 0.0))
        cost = job.prompt_tokens + job.predicted_tokens()
        self.finish_tags[job.tenant] = start + cost / weight
        self.start_tags[job.id] = start

    def on_start(self, job: Job, now: float) -> None:
        self.virtual_time = max(self.virtual_time, self.start_tags[job.id])

    def on_finish(self, job: Job, now: float) -> None:
        self.start_tags.pop(job.id, None)
