"""Several gateway replicas in front of several engines (`loadgen.sim.replicas`): one replica on
one backend is the plain simulator exactly, admission modes bound what a backend holds, random
balancing is seeded, and a shared budget granted by queue heads is one logical queue."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable

import pytest

import sagesched_cli
from loadgen.engine.configs import engine_config
from loadgen.engine.model import Engine
from loadgen.schema import TraceRequest
from loadgen.sim.replicas import ADMISSIONS, BALANCINGS, Admission, Replicas, simulate_replicas
from loadgen.sim.simulator import Contender, SimResult, resolve, simulate
from policies.capacity import CapLaw
from policies.registry import parse_policy


def _req(t: float, prompt: int, out: int, slack: float = 10.0) -> TraceRequest:
    return TraceRequest(t, prompt, out, "t", predicted_output_tokens=out, deadline_s=t + slack)


WORKLOAD = [_req(i * 0.0007, 30 + 211 * i % 1500, 1 + 53 * i % 150) for i in range(80)]
"""80 requests in 56 ms on the 1-ms `lssp-constant` engine: a backlog forms behind small caps."""
SLOW = [_req(i * 0.02, 200 + 97 * i % 900, 20 + 37 * i % 300) for i in range(120)]
"""120 requests over 2.4 s on `h200-llama3-8b` (no time grid; the self-tuning cap samples)."""


def _rows(res: SimResult) -> list[tuple[object, ...]]:
    return [dataclasses.astuple(r) for r in res.records]


def _self_tuning(policy: str) -> Contender:
    engine = engine_config("vllm-chunked-prefill")
    return Contender(policy, parse_policy(policy), engine, 4, cap_law=CapLaw(interval_s=0.1))


CASES: dict[str, tuple[list[TraceRequest], str, Callable[[], Contender]]] = {
    "fcfs": (WORKLOAD, "lssp-constant", lambda: resolve("fcfs", inflight_cap=8)),
    "sagesched": (WORKLOAD, "lssp-constant", lambda: resolve("sagesched", inflight_cap=8)),
    "srpt-oracle": (WORKLOAD, "lssp-constant", lambda: resolve("srpt-oracle", inflight_cap=4)),
    "vtc": (WORKLOAD, "lssp-constant", lambda: resolve("vtc", inflight_cap=8)),
    "vllm-fcfs": (WORKLOAD, "lssp-constant", lambda: resolve("vllm-fcfs")),
    "slai": (WORKLOAD, "lssp-constant", lambda: resolve("slai")),
    "fcfs self-tuning": (SLOW, "h200-llama3-8b", lambda: _self_tuning("fcfs")),
    "sagesched self-tuning": (SLOW, "h200-llama3-8b", lambda: _self_tuning("sagesched")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_one_replica_on_one_backend_is_the_plain_simulator(case: str) -> None:
    requests, profile, make = CASES[case]
    contender = make()
    plain = simulate(requests, contender, profile)
    assert any(r.first_token_s != r.arrival_s for r in plain.records)
    for admission in ADMISSIONS:
        if admission == "split" and (contender.cap_law or contender.inflight_cap is None):
            continue
        setup = Replicas(1, 1, admission=admission)
        res = simulate_replicas(requests, contender, profile, setup)
        assert _rows(res) == _rows(plain), admission
        assert res.iterations == plain.iterations
        assert res.extra.get("cap_mean") == plain.extra.get("cap_mean")


def test_the_self_tuning_cases_really_tune() -> None:
    res = simulate(SLOW, _self_tuning("fcfs"), "h200-llama3-8b")
    assert res.extra["cap_mean"] != 4.0


def _most_held(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record the most requests any engine held at once (waiting + running)."""
    most = [0]
    original = Engine.add

    def add(self: Engine, seq: object) -> None:
        original(self, seq)  # type: ignore[arg-type]
        most[0] = max(most[0], len(self))

    monkeypatch.setattr(Engine, "add", add)
    return most


@pytest.mark.parametrize("admission", ["split", "owned", "shared", "shared-heads"])
def test_only_independent_replicas_over_admit(
    admission: Admission, monkeypatch: pytest.MonkeyPatch
) -> None:
    most = _most_held(monkeypatch)
    contender = resolve("fcfs", inflight_cap=4)
    for balancing in BALANCINGS:
        res = simulate_replicas(WORKLOAD, contender, setup=Replicas(4, 4, balancing, admission))
        assert res.extra["inflight_peak"] <= 4
        assert all(r.completed and r.tokens == r.output_tokens for r in res.records)
    assert most[0] <= 4
    most[0] = 0
    res = simulate_replicas(WORKLOAD, contender, setup=Replicas(4, 4, "round-robin"))
    assert res.extra["inflight_peak"] > 4 and most[0] > 4  # every replica fills the cap


def test_owned_backends_take_only_their_owner_replicas_requests(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engines: dict[int, int] = {}
    backend_of: dict[int, int] = {}
    original = Engine.add

    def add(self: Engine, seq: object) -> None:
        original(self, seq)  # type: ignore[arg-type]
        backend_of[seq.job.id] = engines.setdefault(id(self), len(engines))  # type: ignore[attr-defined]

    monkeypatch.setattr(Engine, "add", add)
    simulate_replicas(
        WORKLOAD, resolve("fcfs", inflight_cap=4), setup=Replicas(2, 4, "round-robin", "owned")
    )
    # round-robin: request i goes to replica i mod 2, which owns the backends b with b mod 2
    # equal to it; engines are numbered here in first-use order, so compare the partition
    by_replica = [{backend_of[i] for i in backend_of if i % 2 == r} for r in range(2)]
    assert len(by_replica[0]) == 2 and len(by_replica[1]) == 2
    assert not by_replica[0] & by_replica[1]


def test_random_balancing_is_seeded() -> None:
    contender = resolve("sagesched", inflight_cap=4)

    def run(seed: int) -> list[tuple[object, ...]]:
        setup = Replicas(4, 4, "random", "independent", seed=seed)
        return _rows(simulate_replicas(WORKLOAD, contender, setup=setup))

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_least_loaded_balancing_spreads_a_burst_evenly() -> None:
    burst = [_req(0.0, 100, 50) for _ in range(8)]
    setup = Replicas(4, 4, "least-loaded", "owned")
    res = simulate_replicas(burst, resolve("fcfs", inflight_cap=1), setup=setup)
    # each replica owns one backend with one slot: two requests each, served back to back
    firsts = sorted(r.first_token_s or 0.0 for r in res.records)
    assert firsts[:4] == [firsts[0]] * 4 and firsts[4:] == [firsts[4]] * 4
    assert firsts[4] > firsts[0]


@pytest.mark.parametrize(
    "policy", ["fcfs", "sagesched:preemptive=false", "srpt-oracle:preemptive=false"]
)
def test_a_budget_granted_by_queue_heads_is_one_logical_queue(policy: str) -> None:
    contender = resolve(policy, inflight_cap=3)
    one = simulate_replicas(WORKLOAD, contender, setup=Replicas(1, 2))
    for balancing in BALANCINGS:
        setup = Replicas(4, 2, balancing, "shared-heads", seed=3)
        assert _rows(simulate_replicas(WORKLOAD, contender, setup=setup)) == _rows(one)


def test_split_caps_add_up_to_the_backend_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    most = _most_held(monkeypatch)
    res = simulate_replicas(
        WORKLOAD, resolve("fcfs", inflight_cap=5), setup=Replicas(2, 1, "random", "split")
    )
    assert most[0] == 5 and res.extra["inflight_peak"] == 5  # shares 3 + 2, both filled


@pytest.mark.parametrize(
    ("setup", "contender"),
    [
        (dict(count=4, backends=2, admission="owned"), resolve("fcfs", inflight_cap=4)),
        (dict(count=2, backends=2, admission="split"), _self_tuning("fcfs")),
        (dict(count=8, backends=2, admission="split"), resolve("fcfs", inflight_cap=4)),
        (dict(count=2, backends=2, balancing="nearest"), resolve("fcfs", inflight_cap=4)),
        (dict(count=0, backends=2), resolve("fcfs", inflight_cap=4)),
    ],
)
def test_impossible_setups_are_refused(setup: dict[str, object], contender: Contender) -> None:
    with pytest.raises(ValueError):
        simulate_replicas(WORKLOAD, contender, setup=Replicas(**setup))  # type: ignore[arg-type]


def test_every_mode_finishes_every_request_with_a_preemptive_policy() -> None:
    contender = resolve("srpt-oracle", inflight_cap=3)
    for admission in ADMISSIONS:
        for balancing in BALANCINGS:
            setup = Replicas(3, 3, balancing, admission)
            res = simulate_replicas(WORKLOAD, contender, setup=setup)
            assert all(r.completed and r.tokens == r.output_tokens for r in res.records), (
                setup.label
            )


def test_simulate_cli_runs_replicas(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--source", "lssp-burstgpt", "--windows", "1", "--region", "KNEE",
            "--policies", "fcfs", "--replicas", "2", "--backends", "2", "--admission", "owned",
            "--json"]  # fmt: skip
    assert sagesched_cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["replicas"] == "N=2 B=2 least-loaded owned"
    assert out["contenders"]["fcfs"]["completion_fraction"] == 1.0
    argv[argv.index("--replicas") + 1] = "3"  # more replicas than backends: no owners for all
    assert sagesched_cli.main(argv) == 2
    assert "owned admission needs" in capsys.readouterr().out
