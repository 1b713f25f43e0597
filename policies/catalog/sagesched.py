"""SageSched: the Gittins index over the predicted *cost* distribution.

The predictor's length distribution (conditioned on the tokens generated so far, capped at
`max_tokens`) becomes a cost distribution through the chosen cost model (`kv` by default:
O²/2 + I·O, memory and compute together). The key is minus the Gittins index, so the job with
the best chance of finishing per unit of expected cost goes first. The index only changes its
candidate horizons at support points, so the key is reviewed when generation crosses the next
one; a waiting job beats a running one by index, which is when preemption pays.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from policies.base import Key, Policy, param
from policies.cost import COST_MODELS, CostModel, attained_cost, make_cost_model
from policies.dist import LengthDist
from policies.gittins import gittins_index
from policies.job import Job
from policies.registry import register_policy


@register_policy
@dataclass(eq=False)
class SageSched(Policy):
    name = "sagesched"
    description = "Gittins index over the predicted cost distribution (cost: kv, tokens or time)."
    needs_prediction = True
    preemptive: bool = param(True, "preempt a running job when a waiting one has a higher index")
    cost: str = param("kv", "cost model: " + ", ".join(COST_MODELS))
    _model: CostModel = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._model = make_cost_model(self.cost)

    def belief(self, job: Job) -> LengthDist:
        """The job's length distribution as SageSched uses it: capped, then conditioned."""
        assert job.dist is not None, "SageSched needs a predicted distribution"
        dist = job.dist
        if job.max_tokens is not None and dist.support[-1] > job.max_tokens:
            dist = dist.truncate(job.max_tokens)
        if job.generated >= dist.support[0]:
            dist = dist.condition(job.generated)
        return dist

    def key(self, job: Job, now: float) -> Key:
        dist = self.belief(job)
        support = self._model.cost(job.prompt_tokens, dist.support)
        spent = attained_cost(self._model, job.prompt_tokens, job.generated)
        return (-gittins_index(support, dist.probs, spent),)

    def next_review(self, job: Job) -> int | None:
        support = self.belief(job).support
        i = int(np.searchsorted(support, job.generated, side="right"))
        return math.ceil(support[i]) if i < support.size else None
