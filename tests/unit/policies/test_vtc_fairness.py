"""VTC keeps the service gap between two backlogged tenants within its bound."""

from __future__ import annotations

from collections import defaultdict

from policies import Job, Scheduler, make_policy

PROFILES = {"a": (50, 200), "b": (500, 20)}  # tenant -> (prompt tokens, output tokens)
SLOTS = 2


def run(policy_name: str, steps: int = 6000) -> list[float]:
    """Two always-backlogged tenants, `a` sending 3× as many requests; two decode slots each
    producing a token per step. Returns |service_a − service_b| after every step, with
    service = prompt + 2·output tokens received (VTC's own cost measure)."""
    s = Scheduler(make_policy(policy_name))
    served: dict[str, float] = defaultdict(float)
    ids = iter(range(10**9))
    t = 0.0

    def submit(tenant: str, count: int) -> None:
        prompt, _ = PROFILES[tenant]
        for _ in range(count):
            s.admit(Job(id=next(ids), arrival_s=t, prompt_tokens=prompt, tenant=tenant), t)

    submit("a", 30)
    submit("b", 10)
    gaps = []
    for step in range(steps):
        t = float(step)
        while len(s.running) < SLOTS and (j := s.dispatch(t)) is not None:
            served[j.tenant] += j.prompt_tokens
        for j in list(s.running.values()):
            s.progress(j, 1, t)
            served[j.tenant] += 2
            if j.generated == PROFILES[j.tenant][1]:
                s.finish(j, t)
        if step % 50 == 0:  # keep both backlogged, `a` at three times the rate
            submit("a", 3)
            submit("b", 1)
        gaps.append(abs(served["a"] - served["b"]))
    return gaps


def test_vtc_gap_bounded_while_fcfs_drifts() -> None:
    u = max(p + 2 * o for p, o in PROFILES.values())  # largest single-request cost
    vtc = run("vtc")
    assert max(vtc[500:]) <= 2 * SLOTS * u
    fcfs = run("fcfs")
    assert max(fcfs) > 4 * SLOTS * u  # the check is not vacuous: FCFS follows arrivals
