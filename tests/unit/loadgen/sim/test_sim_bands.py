"""The simulator runs the `bands` composition unchanged: one band and one tenant is the inner
policy exactly; classes from the trace's `priority` are served band first."""

from __future__ import annotations

import dataclasses

from loadgen.metrics import summarize
from loadgen.schema import TraceRequest
from loadgen.sim.simulator import resolve, simulate


def _req(i: int, *, priority: int = 0, tenant: str | None = None) -> TraceRequest:
    t, out = i * 0.0007, 1 + 53 * i % 150
    prompt = 30 + 211 * i % 1500
    return TraceRequest(
        t, prompt, out, "t", tenant=tenant, predicted_output_tokens=out, deadline_s=t + 10,
        priority=priority,
    )  # fmt: skip


WORKLOAD = [_req(i) for i in range(120)]


def test_one_band_one_tenant_runs_as_the_inner_policy() -> None:
    for inner in ("sagesched", "fcfs", "srpt-oracle"):
        alone = simulate(WORKLOAD, resolve(inner, inflight_cap=8))
        banded = simulate(WORKLOAD, resolve(f"bands:inner={inner}", inflight_cap=8))
        times = lambda res: [(r.first_token_s, r.finish_s, r.preemptions) for r in res.records]  # noqa: E731
        assert times(banded) == times(alone), inner


def test_the_urgent_band_is_served_first_under_overload() -> None:
    mixed = [
        dataclasses.replace(r, priority=0 if i % 4 == 0 else 2) for i, r in enumerate(WORKLOAD)
    ]
    res = simulate(mixed, resolve("bands:inner=fcfs", inflight_cap=4))
    urgent = [r for r, q in zip(res.records, mixed, strict=True) if q.priority == 0]
    rest = [r for r, q in zip(res.records, mixed, strict=True) if q.priority == 2]
    assert summarize(urgent)["ttft_s_mean"] < 0.5 * summarize(rest)["ttft_s_mean"]
    flat = simulate(mixed, resolve("fcfs", inflight_cap=4))
    flat_urgent = [r for r, q in zip(flat.records, mixed, strict=True) if q.priority == 0]
    assert summarize(urgent)["ttft_s_mean"] < summarize(flat_urgent)["ttft_s_mean"]
