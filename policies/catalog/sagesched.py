"""SageSched: the Gittins index over the predicted *cost* distribution.

The predictor's length distribution (conditioned on the tokens generated so far, capped at
`max_tokens`) becomes a cost distribution through the chosen cost model (`kv` by default:
O²/2 + I·O, memory and compute together). The key is minus the Gittins index, so the job with
the best chance of finishing per unit of expected cost goes first. The index only changes its
candidate horizons at support points, so the key is reviewed when generation crosses the next
one. A waiting job that beats a running one by index displaces it only when the swap pays
(`preempt_rule="pays"`, derived in docs/policies.md): the waiting job must start earlier by more
than the victim's recompute costs everyone served after it (the batch and the queue), reckoned
under the engine's cost profile; in a large batch a slot frees soon anyway and it never pays.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Self

import numpy as np

from policies.base import Key, Policy, engine_param, param
from policies.cost import COST_MODELS, CostModel, LinearProfile, attained_cost, make_cost_model
from policies.dist import LengthDist, overrun_length
from policies.gittins import gittins_index
from policies.job import Job
from policies.registry import register_policy

PREEMPT_RULES = ("pays", "index")
DEFAULT_ENGINE = LinearProfile(
    prefill_base_s=5.16e-3, prefill_s_per_token=1.99e-5, step_s=9.35e-5, context_s_per_token=2.79e-8
)
"""Costs assumed when no engine said what a request costs: the `h200-llama3-8b` profile's at a
batch of 64 (`loadgen.engine.profiles.LatencyProfile.cost_profile`); the rule only reads the
ratio of prefill to decode cost, which is of this order on GPU engines."""


@register_policy
@dataclass(eq=False)
class SageSched(Policy):
    name = "sagesched"
    description = "Gittins index over the predicted cost distribution (cost: kv, tokens or time)."
    needs_prediction = True
    preemptive: bool = param(True, "preempt a running job when a waiting one has a higher index")
    cost: str = param("kv", "cost model: " + ", ".join(COST_MODELS))
    preempt_rule: str = param(
        "pays", "pays: a higher index and a saving above the recompute cost; index: index alone"
    )
    latency: LinearProfile | None = engine_param()
    """The engine's per-request cost (`time` cost model, preemption rule); set by `on_engine`."""
    _model: CostModel = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.preempt_rule not in PREEMPT_RULES:
            raise ValueError(f"preempt_rule: one of {PREEMPT_RULES}, not {self.preempt_rule!r}")
        if self.cost == "time" and self.latency is None:
            # no engine told us its costs yet: decode steps only, until `on_engine` does
            self._model = make_cost_model("time", LinearProfile())
        else:
            self._model = make_cost_model(self.cost, self.latency)

    def on_engine(self, cost: LinearProfile) -> Self:
        return self if self.latency is not None else dataclasses.replace(self, latency=cost)

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
        cached = job.cached_tokens
        support = self._model.cost(job.prompt_tokens, dist.support, cached)
        spent = attained_cost(self._model, job.prompt_tokens, job.generated, cached)
        return (-gittins_index(support, dist.probs, spent),)

    def preemption_pays(
        self, waiting: Job, victim: Job, running: Sequence[Job], n_waiting: int
    ) -> bool:
        """Does swapping `victim` out for `waiting` lower the sum of completion times?

        Every running sequence advances one token per iteration of τ = n·step, so a swap only
        moves start times (docs/policies.md). Without it, the waiting job starts when a slot
        frees: after F = the fewest expected remaining tokens among the other running jobs, or
        R_v if the victim ends first. With it, the victim waits for that slot instead, after
        min(R_w, F). Saving: (min(R_v, F) − min(R_w, F))·τ. Cost: the victim's recompute
        (prompt plus generated tokens) is engine time taken from every job served after it,
        the n running and the queue. In a large batch F is a few tokens and a swap never pays;
        with few slots of long jobs it is SRPT's swap minus the recompute.
        """
        if self.preempt_rule == "index":
            return True
        lat = self.latency or DEFAULT_ENGINE
        others = [self._remaining(j) for j in running if j is not victim]
        free_in = min(others, default=math.inf)
        r_victim, r_waiting = self._remaining(victim), self._remaining(waiting)
        n = max(len(running), 1)
        saving_s = (min(r_victim, free_in) - min(r_waiting, free_in)) * lat.step_s * n
        recompute_s = lat.prefill_s_per_token * (victim.prompt_tokens + victim.generated)
        return saving_s > (n + n_waiting) * recompute_s

    def _remaining(self, job: Job) -> float:
        """Expected output tokens still to come."""
        return self.belief(job).mean() - job.generated

    def next_review(self, job: Job) -> int | None:
        """The first support point of the belief above `generated`, read off the predicted
        support without building the belief (this runs at every review of every running job):
        a point below the cap, else the cap itself (mass above it sits there), else, the job
        having outlived them all, the overrun point "as long again" (`LengthDist.condition`)."""
        assert job.dist is not None, "SageSched needs a predicted distribution"
        support, generated = job.dist.support, job.generated
        i = int(np.searchsorted(support, generated, side="right"))
        point = float(support[i]) if i < support.size else math.inf
        if job.max_tokens is not None and support[-1] > job.max_tokens:
            point = min(point, max(1.0, float(job.max_tokens)))
        if point <= generated or math.isinf(point):  # outlived the (capped) support
            point = overrun_length(generated)
        return math.ceil(point)
