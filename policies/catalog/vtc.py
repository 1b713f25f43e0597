"""Virtual Token Counter fairness (Sheng et al., OSDI 2024).

Each tenant has a counter charged `input_weight` per prompt token when a job starts and
`output_weight` per output token as it is generated, divided by the tenant's weight. The
backlogged tenant with the lowest counter goes next (arrival order within a tenant). A tenant
that becomes backlogged again is lifted to the lowest counter among the backlogged ones, so
idling earns no credit. Counters only rise, so the queue's stored keys are lower bounds and it
revalidates its head (`revalidate_on_pop`) instead of rekeying every job of a tenant.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from policies.base import Key, Policy, param, state
from policies.job import Job
from policies.registry import register_policy


@register_policy
@dataclass(eq=False)
class VTC(Policy):
    name = "vtc"
    description = "Virtual token counter per tenant (input ×1, output ×2), lifted on re-entry."
    revalidate_on_pop = True
    input_weight: float = param(1.0, "counter charge per prompt token")
    output_weight: float = param(2.0, "counter charge per output token")
    tenant_weights: tuple[tuple[str, float], ...] = param((), "(tenant, weight) pairs; default 1")
    counters: defaultdict[str, float] = state(lambda: defaultdict(float))
    backlog: defaultdict[str, int] = state(lambda: defaultdict(int))

    def _weight(self, tenant: str) -> float:
        return dict(self.tenant_weights).get(tenant, 1.0)

    def key(self, job: Job, now: float) -> Key:
        return (self.counters[job.tenant],)

    def on_admit(self, job: Job, now: float) -> None:
        t = job.tenant
        if self.backlog[t] == 0:
            others = [self.counters[u] for u, n in self.backlog.items() if n > 0 and u != t]
            if others:
                self.counters[t] = max(self.counters[t], min(others))
        self.backlog[t] += 1

    def on_start(self, job: Job, now: float) -> None:
        self.counters[job.tenant] += (
            self.input_weight * job.prompt_tokens / self._weight(job.tenant)
        )

    def on_progress(self, job: Job, new_tokens: int, now: float) -> None:
        self.counters[job.tenant] += self.output_weight * new_tokens / self._weight(job.tenant)

    def on_finish(self, job: Job, now: float) -> None:
        self.backlog[job.tenant] -= 1
