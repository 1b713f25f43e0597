"""Engine invariants: KV within capacity, tokens conserved, nothing lost or duplicated, the
step conventions, preemption order, and multi-iteration jumps equal to single steps."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loadgen.engine.configs import CONTINUOUS, engine_config
from loadgen.engine.model import Engine, Seq, StepResult
from loadgen.engine.profiles import make_profile
from loadgen.schema import TraceRequest
from loadgen.sim.simulator import Contender, simulate
from policies.job import Job
from policies.registry import parse_policy

PAGED = ["vllm-fcfs", "vllm-chunked-prefill", "sarathi", "slai"]


def _req(t: float, prompt: int, out: int, slack: float = 10.0) -> TraceRequest:
    return TraceRequest(t, prompt, out, "test", predicted_output_tokens=out, deadline_s=t + slack)


def _fcfs_on(engine: str, **changes: object) -> Contender:
    return Contender("fcfs", parse_policy("fcfs"), engine_config(engine).with_(**changes), None)


@pytest.fixture
def kv_watch(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[int, int]]]:
    """Records (free units, capacity) after every engine step (cleared by each example)."""
    seen: list[tuple[int, int]] = []
    original = Engine.step

    def step(self: Engine, now: float, horizon_s: float) -> StepResult:
        res = original(self, now, horizon_s)
        seen.append((self.free_blocks, self.capacity))
        held = sum(s.blocks for s in self.running) + sum(s.blocks for s in self.waiting)
        assert held + self.free_blocks == self.capacity, "KV units leaked"
        return res

    monkeypatch.setattr(Engine, "step", step)
    yield seen


workloads = st.lists(
    st.tuples(
        st.floats(0.0, 0.05), st.integers(1, 3000), st.integers(1, 300), st.floats(0.01, 5.0)
    ),
    min_size=1,
    max_size=40,
)


@pytest.mark.parametrize("engine", PAGED)
@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(rows=workloads)
def test_paged_engines_keep_kv_within_capacity_and_conserve_tokens(
    engine: str, rows: list[tuple[float, int, int, float]], kv_watch: list[tuple[int, int]]
) -> None:
    kv_watch.clear()
    reqs = sorted((_req(*r) for r in rows), key=lambda r: r.arrival_s)
    c = _fcfs_on(engine, kv_tokens=8192)  # small KV: forces preemption
    res = simulate(reqs, c)
    assert all(0 <= free <= cap for free, cap in kv_watch)
    assert len(res.records) == len(reqs)
    assert sorted(r.id for r in res.records) == list(range(len(reqs)))
    for rec in res.records:
        if rec.completed:
            assert rec.tokens == rec.output_tokens
            assert rec.first_token_s is not None and rec.finish_s is not None
            assert rec.arrival_s < rec.first_token_s <= rec.finish_s
        else:
            assert rec.dropped and rec.tokens < rec.output_tokens


def test_prompt_larger_than_kv_is_dropped_not_lost() -> None:
    res = simulate([_req(0.0, 20_000, 5)], _fcfs_on("vllm-fcfs", kv_tokens=8192, drain_s=1.0))
    assert res.records[0].dropped and res.records[0].finish_s is None


def test_first_token_and_finish_follow_the_step_convention() -> None:
    # admitted in the iteration starting at 3 ms (arrival 2.5 ms rounds up to the grid), O = 7:
    # first token at the end of that iteration (4 ms), finish at the end of iteration 3+7-1
    res = simulate([_req(0.0025, 100, 7)], Contender("f", parse_policy("fcfs"), CONTINUOUS, None))
    rec = res.records[0]
    assert rec.first_token_s == pytest.approx(0.004)
    assert rec.finish_s == pytest.approx(0.010)
    assert res.iterations == 7


def test_finish_exactly_at_the_deadline_meets_it() -> None:
    res = simulate([_req(0.0, 10, 5, slack=0.005)], "fcfs")
    assert res.records[0].finish_s == pytest.approx(0.005)
    assert res.records[0].met_slo()
    late = simulate([_req(0.0, 10, 6, slack=0.005)], "fcfs")
    assert not late.records[0].met_slo()


def test_jumps_give_the_same_schedule_as_single_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    reqs = [_req(i * 0.0013, 50 + 97 * i % 900, 1 + 37 * i % 120) for i in range(60)]
    for engine in ["continuous", "vllm-fcfs", "sarathi", "kv-constrained"]:
        c = _fcfs_on(engine, kv_tokens=16_384)
        fast = simulate(reqs, c, "h200-llama3-8b")
        with monkeypatch.context() as m:
            m.setattr(Engine, "_jump", lambda self, b, now, h: 1)
            slow = simulate(reqs, c, "h200-llama3-8b")
        assert fast.engine_steps < slow.engine_steps
        assert fast.iterations == slow.iterations
        for a, b in zip(fast.records, slow.records, strict=True):
            assert a.finish_s == pytest.approx(b.finish_s, rel=1e-9, abs=1e-12)
            assert a.first_token_s == pytest.approx(b.first_token_s, rel=1e-9, abs=1e-12)


def _seq(i: int, prompt: int, out: int, priority: int = 0) -> Seq:
    job = Job(i, arrival_s=i * 0.001, prompt_tokens=prompt, priority=priority)
    return Seq(job, out, float(out))


def test_recompute_preemption_takes_the_last_admitted_and_requeues_it_first() -> None:
    cfg = engine_config("vllm-fcfs").with_(kv_tokens=16 * 20, watermark_fraction=0.0)
    eng = Engine(cfg, make_profile("lssp-constant"))
    seqs = [_seq(i, 16 * 5 - 1, 100) for i in range(3)]  # 5 blocks each with the first token
    for s in seqs:
        eng.add(s)
    t = 0.0
    while seqs[2] not in eng.running:
        t += eng.step(t, 1.0).dt_s
    while eng.preemptions == 0:
        t += eng.step(t, 1.0).dt_s
    assert seqs[2] in eng.waiting and eng.waiting[0] is seqs[2]
    assert seqs[2].preemptions == 1 and seqs[2].kv == 0 and seqs[2].blocks == 0
    assert seqs[2].prefill_left == seqs[2].prompt + seqs[2].generated


def test_priority_scheduling_preempts_the_least_urgent() -> None:
    cfg = engine_config("vllm-fcfs").with_(
        kv_tokens=16 * 20, watermark_fraction=0.0, priority_scheduling=True
    )
    eng = Engine(cfg, make_profile("lssp-constant"))
    seqs = [_seq(0, 79, 100, priority=5), _seq(1, 79, 100), _seq(2, 79, 100)]
    for s in seqs:
        eng.add(s)
    t = 0.0
    while eng.preemptions == 0:
        t += eng.step(t, 1.0).dt_s
    assert seqs[0].preemptions == 1 and seqs[1].preemptions == seqs[2].preemptions == 0
