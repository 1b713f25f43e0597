"""`sagesched`: the backend where sending the job costs the fleet the least time.

The cost is in the engine's seconds, from the profile SageSched orders by
(`policies.cost.LinearProfile`, the engine's per-request profile bound through `on_engine`;
`DEFAULT_ENGINE` until then), for a job of I prompt tokens and expected output O, on each
backend b with room (r_b running there, w_b waiting in its engine, n_b in flight):

    cost_b = prefill(I − c_b)                      its uncached prefill (c_b: cached prefix on b)
           + s · r_b · prefill_s_per_token · (I − c_b)  the same tokens stall every sequence
                                                   running on b (a prefill chunk is part of
                                                   their iterations; its fixed cost is theirs
                                                   anyway), weighted by `stall_weight` s
           + w_b · q_b                             the prefills queued ahead of it in b's engine
                                                   (q_b: the mean uncached prefill of the jobs
                                                   this router sent to b; the job's own full
                                                   prefill before it sent any)
           + load_weight · (n_b + 1) · decode(I, O) its decode, stretched by the batch it joins

prefill(x) = prefill_base_s + prefill_s_per_token·x; decode(I, O) = O·step_s +
context_s_per_token·(I·O + O(O−1)/2), the `time` cost's decode. Every running sequence
advances one token per iteration, which takes about n·step_s with n sequences (the profile's
per-request share; the same reading as SageSched's preemption rule, docs/policies.md), so a
job's decode stretches with the batch it joins. That share includes the iteration's fixed
cost split over the batch; what one more sequence really adds is its marginal cost, about a
tenth of the share on `h200-llama3-8b` at 32 sequences (0.0146 of 0.17 ms), hence
`load_weight` 0.1. The stall term is what makes a cache hit worth more than the prefill the
job itself skips: on a backend running 20 sequences, a 1,000-token prefill skipped saves
about 20 ms for each of them. At full weight it also piles jobs onto the backends holding
their prefix, whose engine queues then grow faster than `q_b` says; `stall_weight` 0.3 was
the best of 0, 0.3 and 1 in the routing study (docs/routing.md, `exp-stall.md`). c_b comes
from the prefix index (`PrefixRouter`); O is the mean of the job's predicted distribution
(then its true length for oracles, `max_tokens`, `default_output_tokens`). `on_route` sets
`Job.cached_tokens`, which SageSched's `time` cost then leaves out of the prefill it charges.
Ties: the lower in-flight/cap, then the earlier backend.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Self

from policies.base import engine_param, param, state
from policies.catalog.sagesched import DEFAULT_ENGINE
from policies.cost import LinearProfile
from policies.job import Job
from policies.routing.base import BackendState, PrefixRouter, open_backends
from policies.routing.registry import register_router

QUEUED_WEIGHT = 0.1
"""Weight of the newest job in a backend's moving average of uncached prefill (about the last
ten jobs sent there)."""


@register_router
@dataclass(eq=False)
class SageSchedRouter(PrefixRouter):
    name = "sagesched"
    description = "least time cost to the fleet: prefill and its stall, engine queue, service"
    load_weight: float = param(
        0.1, "marginal over average per-sequence iteration cost (the batch-stretch weight)"
    )
    default_output_tokens: int = param(256, "output tokens assumed when nothing predicts them")
    stall_weight: float = param(
        0.3, "weight of the running batch's stall (0: the job's own prefill only)"
    )
    latency: LinearProfile | None = engine_param()
    """The engine's per-request cost; set by `on_engine`."""
    _queued: dict[str, float] = state(dict)
    """Per backend: the mean uncached prefill (s) of the jobs sent there (moving average)."""

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
        tokens_s = lat.prefill_s_per_token * prompt  # the prefill's per-token part
        full_prefill = lat.prefill_base_s + tokens_s
        per_block = lat.prefill_s_per_token * job.block_tokens
        stall_weight, queued = self.stall_weight, self._queued
        best, best_key = candidates[0], (float("inf"), 0.0)
        for b in candidates:
            uncached = tokens_s - min(self.cached_blocks(job, b) * per_block, tokens_s)
            waiting = b.waiting or 0
            running = b.inflight - waiting if b.inflight > waiting else 0
            cost = (
                lat.prefill_base_s
                + uncached * (1.0 + stall_weight * running)  # own wait + the batch's stall
                + waiting * queued.get(b.name, full_prefill)  # the engine's queue ahead
                + (b.inflight + 1) * service
            )
            key = (cost, b.load)
            if key < best_key:
                best, best_key = b, key
        return best

    def on_route(self, job: Job, backend: BackendState) -> None:
        super().on_route(job, backend)
        lat = self.latency or DEFAULT_ENGINE
        uncached = lat.prefill_s(job.prompt_tokens - job.cached_tokens)
        last = self._queued.get(backend.name)
        self._queued[backend.name] = (
            uncached if last is None else last + QUEUED_WEIGHT * (uncached - last)
        )

    def expected_output(self, job: Job) -> float:
        """Expected total output tokens of `job` (the prediction's mean, capped)."""
        if job.dist is not None:
            mean = job.dist.mean()
            return min(mean, job.max_tokens) if job.max_tokens is not None else mean
        for known in (job.true_output_tokens, job.max_tokens):
            if known is not None:
                return float(known)
        return float(self.default_output_tokens)
