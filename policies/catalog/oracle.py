"""Oracle bounds: shortest job / shortest remaining job first with the true length.

They need `true_output_tokens`, so they run only in simulation and studies, where they bound
what any length predictor could buy.
"""

from __future__ import annotations

from dataclasses import dataclass

from policies.base import Key, Policy, param
from policies.job import Job
from policies.registry import register_policy


def _true_length(job: Job) -> int:
    if job.true_output_tokens is None:
        raise ValueError(f"job {job.id} has no true length (oracle policies need one)")
    return job.true_output_tokens


@register_policy
@dataclass(eq=False)
class SJFOracle(Policy):
    name = "sjf-oracle"
    description = "Shortest job first by the true output length; non-preemptive upper bound."
    needs_oracle = True

    def key(self, job: Job, now: float) -> Key:
        return (float(_true_length(job)),)


@register_policy
@dataclass(eq=False)
class SRPTOracle(Policy):
    name = "srpt-oracle"
    description = "Shortest remaining output first by the true length; preemptive upper bound."
    needs_oracle = True
    preemptive: bool = param(True, "preempt a running job when a shorter one waits")

    def key(self, job: Job, now: float) -> Key:
        return (float(_true_length(job) - job.generated),)

    def next_review(self, job: Job) -> int | None:
        return job.generated + 1  # remaining work shrinks with every token
