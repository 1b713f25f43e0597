"""`sagesched`: the backend where the job's expected completion cost is lowest.

The cost is the one SageSched orders by (`policies.cost.LinearProfile`, the engine's
per-request profile bound through `on_engine`; `DEFAULT_ENGINE` until then), taken on each
backend b with room, for a job of I prompt tokens and expected output O:

    cost_b = prefill(I − c_b)                      uncached prefill (c_b: cached prefix on b)
           + w_b · prefill(I)                      wait: the w_b requests queued in b's engine
                                                   prefill first (sizes unseen: like this one)
           + load_weight · (n_b + 1) · decode(I, O) service in a batch with b's n_b in flight

prefill(x) = prefill_base_s + prefill_s_per_token·x; decode(I, O) = O·step_s +
context_s_per_token·(I·O + O(O−1)/2), the `time` cost's decode. Every running sequence
advances one token per iteration, which takes about n·step_s with n sequences (the profile's
per-request share; the same reading as SageSched's preemption rule, docs/policies.md), so a
job's decode stretches with the batch it joins. That share includes the iteration's fixed
cost split over the batch; what one more sequence really adds is its marginal cost, about a
tenth of the share on `h200-llama3-8b` at 32 sequences (0.0146 of 0.17 ms), hence
`load_weight` 0.1 (`bench/slot_choice.py`: 1.0 sent too many jobs away from their cache).
c_b comes from the prefix index (`PrefixRouter`); O is the mean of the job's predicted
distribution (then its true length for oracles, `max_tokens`, `default_output_tokens`). A
long job weighs load, a short one with a long shared prompt weighs its cached prefix.
`on_route` sets `Job.cached_tokens`, which SageSched's `time` cost then leaves out of the
prefill it charges. Ties: the lower in-flight/cap, then the earlier backend.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Self

from policies.base import engine_param, param
from policies.catalog.sagesched import DEFAULT_ENGINE
from policies.cost import LinearProfile
from policies.job import Job
from policies.routing.base import BackendState, PrefixRouter, open_backends
from policies.routing.registry import register_router


@register_router
@dataclass(eq=False)
class SageSchedRouter(PrefixRouter):
    name = "sagesched"
    description = "least expected completion cost: uncached prefill + engine wait + service"
    load_weight: float = param(
        0.1, "marginal over average per-sequence iteration cost (the batch-stretch weight)"
    )
    default_output_tokens: int = param(256, "output tokens assumed when nothing predicts them")
    latency: LinearProfile | None = engine_param()
    """The engine's per-request cost; set by `on_engine`."""

    def on_engine(self, cost: LinearProfile) -> Self:
        return self if self.latency is not None else dataclasses.replace(self, latency=cost)

    def pick(self, job: Job, backends: Sequence[BackendState]) -> BackendState | None:
        candidates = open_backends(backends)
        if len(candidates) <= 1:
            return candidates[0] if candidates else None
        lat = self.latency or DEFAULT_ENGINE
        prompt = job.prompt_tokens
        out = self.expected_output(job)
        decode = out * lat.step_s + lat.context_s_per_token * (prompt * out + out * (out - 1) / 2)
        service = self.load_weight * decode
        full_prefill = lat.prefill_base_s + lat.prefill_s_per_token * prompt
        per_block = lat.prefill_s_per_token * job.block_tokens
        best, best_key = candidates[0], (float("inf"), 0.0)
        for b in candidates:
            cached = min(self.cached_blocks(job, b) * per_block, full_prefill - lat.prefill_base_s)
            wait = (b.waiting or 0) * full_prefill
            cost = full_prefill - cached + wait + (b.inflight + 1) * service
            key = (cost, b.load)
            if key < best_key:
                best, best_key = b, key
        return best

    def expected_output(self, job: Job) -> float:
        """Expected total output tokens of `job` (the prediction's mean, capped)."""
        if job.dist is not None:
            mean = job.dist.mean()
            return min(mean, job.max_tokens) if job.max_tokens is not None else mean
        for known in (job.true_output_tokens, job.max_tokens):
            if known is not None:
                return float(known)
        return float(self.default_output_tokens)
