"""Every registered router passes the same checks; new routers are picked up automatically."""

from __future__ import annotations

import random

import numpy as np
import pytest

from policies import Job, LengthDist
from policies.routing import (
    BackendState,
    Router,
    make_router,
    parse_router,
    register_router,
    router_class,
    router_names,
)

N_BACKENDS = 5


def fleet() -> list[BackendState]:
    """Small caps so backends fill up, with KV sized in 16-token engine blocks."""
    return [
        BackendState(f"b{i}", inflight=0, cap=2 + i % 3, kv_blocks=64 * (i + 1))
        for i in range(N_BACKENDS)
    ]


def workload(seed: int, n: int = 300) -> list[Job]:
    """Multi-turn sessions: a turn's prefix extends the session's previous one; some jobs
    carry no prefix or no session; chained hashes are unique per (session, depth)."""
    rng = random.Random(seed)
    prefixes: dict[int, tuple[int, ...]] = {}
    jobs = []
    for i in range(n):
        s = rng.randrange(12)
        grown = prefixes.get(s, ()) + tuple(
            (s << 32) | (len(prefixes.get(s, ())) + k) for k in range(rng.randrange(1, 6))
        )
        prefixes[s] = grown
        with_prefix = rng.random() < 0.9
        true = rng.randrange(1, 400)
        jobs.append(
            Job(
                id=i,
                arrival_s=float(i),
                prompt_tokens=len(grown) * 16 + rng.randrange(16),
                session=f"s{s}" if rng.random() < 0.8 else None,
                prefix=grown if with_prefix else (),
                block_tokens=16 if with_prefix else 0,
                dist=LengthDist.noisy_oracle(
                    true, 0.5, np.random.default_rng(rng.randrange(2**32))
                ),
                true_output_tokens=true,
            )
        )
    return jobs


def drive(router: Router, seed: int) -> list[str | None]:
    """Route a workload through a fleet whose load, health and metrics change; check every
    decision against the contract; return the decisions (backend names, None = held)."""
    rng = random.Random(seed + 1)
    backends = fleet()
    running: list[tuple[Job, BackendState]] = []
    out: list[str | None] = []
    for job in workload(seed):
        while running and rng.random() < 0.45:
            done, where = running.pop(rng.randrange(len(running)))
            where.inflight -= 1
            router.on_finish(done, where)
        if rng.random() < 0.1:
            flip = backends[rng.randrange(N_BACKENDS)]
            flip.serving = not flip.serving
        for b in backends:
            b.waiting = rng.randrange(3) if rng.random() < 0.7 else None
            b.kv_usage = rng.random() if rng.random() < 0.7 else None
        choice = router.pick(job, backends)
        if choice is None:
            assert not any(b.has_room for b in backends), "None while a backend had room"
            out.append(None)
            continue
        assert any(choice is b for b in backends), "picked an object not among the backends"
        assert choice.serving and choice.has_room, f"picked {choice.name} without room"
        router.on_route(job, choice)
        assert 0 <= job.cached_tokens <= job.prompt_tokens
        choice.inflight += 1
        running.append((job, choice))
        out.append(choice.name)
    return out


@pytest.mark.parametrize("name", router_names())
def test_respects_room_and_is_work_conserving(name: str) -> None:
    decisions = drive(make_router(name), seed=5)
    assert None in decisions, "the drive should fill the fleet at times"
    assert len({d for d in decisions if d}) >= 2, "the drive should use several backends"


@pytest.mark.parametrize("name", router_names())
def test_identical_inputs_identical_decisions(name: str) -> None:
    template = make_router(name)
    a, b = template.fresh(), template.fresh()
    assert drive(a, seed=9) == drive(b, seed=9)


@pytest.mark.parametrize("name", router_names())
def test_fresh_resets_per_run_state(name: str) -> None:
    used = make_router(name)
    drive(used, seed=2)  # learns an index, moves a cursor, draws random numbers
    assert drive(used.fresh(), seed=3) == drive(make_router(name), seed=3)


@pytest.mark.parametrize("name", router_names())
def test_no_backends_no_room(name: str) -> None:
    router = make_router(name)
    job = workload(1, n=1)[0]
    assert router.pick(job, []) is None
    full = [
        BackendState("x", inflight=4, cap=4),
        BackendState("y", inflight=0, cap=4, serving=False),
    ]
    assert router.pick(job, full) is None


@pytest.mark.parametrize("name", router_names())
def test_single_open_backend_is_chosen(name: str) -> None:
    router = make_router(name)
    only = BackendState("z", inflight=0, cap=1)
    backends = [BackendState("x", 4, 4), BackendState("y", 0, 4, serving=False), only]
    for job in workload(4, n=20):
        assert router.pick(job, backends) is only


@pytest.mark.parametrize("name", router_names())
def test_contract_metadata_and_specs(name: str) -> None:
    cls = router_class(name)
    assert cls.name == name and cls.description
    router = make_router(name)
    clone = router.fresh()
    assert clone is not router and clone.params() == router.params()
    assert parse_router(router.label()).params() == router.params()
    with pytest.raises(ValueError, match="has no parameter"):
        make_router(name, no_such_parameter=1)


def test_registry_is_loud() -> None:
    cls = router_class("least-loaded")
    with pytest.raises(ValueError, match="registered twice"):
        register_router(cls)
    with pytest.raises(ValueError, match="unknown router 'nope'; known: cache-aware"):
        router_class("nope")
    with pytest.raises(ValueError, match="key=value"):
        parse_router("random:seed")
    assert parse_router("random:seed=3").label() == "random:seed=3"
