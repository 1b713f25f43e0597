"""Each engine-level configuration on a hand-made case where its rule decides the outcome."""

from __future__ import annotations

import pytest

from loadgen.engine.configs import CONTINUOUS, EngineConfig, engine_config, engine_names
from loadgen.engine.model import Engine, Seq
from loadgen.engine.profiles import make_profile
from loadgen.schema import TraceRequest
from loadgen.sim.simulator import Contender, resolve, simulate
from policies.job import Job
from policies.registry import parse_policy, policy_names


def _req(
    t: float, prompt: int, out: int, slack: float = 10.0, pred: int | None = None
) -> TraceRequest:
    return TraceRequest(
        t, prompt, out, "t", predicted_output_tokens=pred or out, deadline_s=t + slack
    )


def _on(cfg: EngineConfig, cap: int | None = None, policy: str = "fcfs") -> Contender:
    return Contender(cfg.name, parse_policy(policy), cfg, cap)


def test_engine_names_are_registered_and_disjoint_from_policies() -> None:
    expected = {"vllm-fcfs", "vllm-chunked-prefill", "sarathi", "slai", "kv-constrained",
                "admission-control", "token-budget", "slo-guard", "continuous"}  # fmt: skip
    assert expected <= set(engine_names())
    assert not set(engine_names()) & set(policy_names())
    with pytest.raises(ValueError, match="registered twice"):
        from loadgen.engine.configs import register_engine

        register_engine(EngineConfig("sarathi", "dup"))


def test_vllm_fcfs_pauses_decodes_for_a_prompt_iteration() -> None:
    reqs = [_req(0.0, 100, 10), _req(0.0035, 100, 3)]
    paper = simulate(reqs, _on(CONTINUOUS))
    vllm = simulate(reqs, "vllm-fcfs")
    assert paper.records[0].finish_s == pytest.approx(0.010)
    assert vllm.records[0].finish_s == pytest.approx(0.011)  # one iteration lost to the prefill


def test_chunked_prefill_spreads_a_long_prompt_over_iterations() -> None:
    whole = simulate([_req(0.0, 5000, 2)], "vllm-fcfs")
    chunked = simulate([_req(0.0, 5000, 2)], "vllm-chunked-prefill")
    assert whole.records[0].first_token_s == pytest.approx(0.001)
    assert chunked.records[0].first_token_s == pytest.approx(0.002)  # 4,096 + 904 tokens


def test_sarathi_keeps_decoding_while_chunking_a_prompt() -> None:
    reqs = [_req(0.0, 10, 20), _req(0.002, 1200, 2)]
    res = simulate(reqs, "sarathi")
    long_prompt = res.records[1]
    assert long_prompt.first_token_s == pytest.approx(0.002 + 0.003)  # 512 + 512 + 176 tokens
    assert res.records[0].finish_s == pytest.approx(0.020)  # never stalled


def test_slai_admits_the_shortest_prompt_first() -> None:
    reqs = [_req(0.0, 600, 2), _req(0.0, 500, 2), _req(0.0, 30, 2)]
    res = simulate(reqs, "slai")  # 30 + the first 482 of 500 fill the 512-token budget
    assert res.records[2].first_token_s == res.records[1].first_token_s == pytest.approx(0.001)
    assert res.records[0].first_token_s > 0.001
    fcfs = simulate(reqs, _on(engine_config("slai").with_(waiting_order="arrival")))
    assert fcfs.records[0].first_token_s == pytest.approx(0.001)


def test_slai_defers_a_decode_that_has_slack_when_prompts_need_the_budget() -> None:
    eng = Engine(engine_config("slai"), make_profile("lssp-constant"))
    running = Seq(Job(0, 0.0, 10), 50, 50.0)
    eng.add(running)
    t = eng.step(0.0, 1.0).dt_s  # prefill + first token
    assert running.generated == 1
    eng.add(Seq(Job(1, t, 512), 5, 5.0))  # needs the whole 512-token budget
    t += eng.step(t, 1e-4).dt_s  # a short horizon: exactly one iteration
    assert running.generated == 1  # deferred: its last schedulable time is ~0.5 s away
    t += eng.step(t, 1e-4).dt_s
    assert running.generated == 2  # budget free again: the non-critical decode is served


def test_kv_constrained_holds_back_non_urgent_requests_above_82_percent() -> None:
    cfg = engine_config("kv-constrained").with_(kv_tokens=1000)
    # request 0 fills 90% of KV; request 1 has plenty of laxity and must wait; 2 is urgent
    reqs = [_req(0.0, 900, 50), _req(0.001, 10, 5, slack=5.0), _req(0.001, 10, 5, slack=0.2)]
    res = simulate(reqs, _on(cfg))
    r0, r1, r2 = res.records
    assert r2.first_token_s == pytest.approx(0.002)  # urgent: admitted at once
    assert r1.first_token_s == pytest.approx(r0.finish_s + 0.001)  # after KV frees
    plain = simulate(reqs, _on(CONTINUOUS.with_(kv_tokens=1000)))
    assert plain.records[1].first_token_s == pytest.approx(0.002)


def test_admission_control_filters_nothing_by_default_and_drops_below_its_threshold() -> None:
    reqs = [_req(0.0, 10, 50, slack=0.01), _req(0.0, 10, 5, slack=1.0)]
    default = simulate(reqs, "admission-control")
    assert not any(r.dropped for r in default.records)
    strict = simulate(reqs, _on(engine_config("admission-control").with_(min_laxity_s=0.0)))
    assert [r.dropped for r in strict.records] == [True, False]


def test_token_budget_serves_the_shortest_predicted_output_first() -> None:
    c = resolve("token-budget", inflight_cap=1)
    reqs = [_req(0.0, 10, 40), _req(0.0001, 10, 30, pred=30), _req(0.0001, 10, 5, pred=5)]
    res = simulate(reqs, c)
    assert res.records[2].finish_s < res.records[1].finish_s
    assert sum(r.preemptions for r in res.records) == 0


def test_slo_guard_orders_by_deadline_and_drops_hopeless_requests() -> None:
    c = resolve("slo-guard", inflight_cap=1)
    reqs = [_req(0.0, 10, 20), _req(0.0001, 10, 5, slack=0.5), _req(0.0001, 10, 5, slack=0.3),
            _req(0.0001, 10, 50, slack=0.02)]  # fmt: skip
    res = simulate(reqs, c)
    assert res.records[2].finish_s < res.records[1].finish_s
    assert res.records[3].dropped


def test_every_engine_config_runs_a_mixed_workload_to_completion() -> None:
    reqs = [_req(i * 0.002, 20 + 131 * i % 2000, 1 + 17 * i % 90, slack=30.0) for i in range(40)]
    for name in engine_names():
        res = simulate(reqs, resolve(name) if name != "continuous" else _on(CONTINUOUS))
        assert all(r.completed for r in res.records), name
        assert all(r.tokens == r.output_tokens for r in res.records), name


def test_slai_prefill_is_free_but_its_chunks_spend_the_budget() -> None:
    """The paper's SLAI: a 1,500-token prompt decodes from its admission iteration, while its
    chunks (512, 512, 476) hold the budget: a deferred decode and a new prompt wait for them."""
    eng = Engine(engine_config("slai"), make_profile("lssp-constant"))
    old = Seq(Job(0, 0.0, 10), 50, 50.0)
    eng.add(old)
    t = eng.step(0.0, 1.0).dt_s
    big = Seq(Job(1, t, 1500), 50, 50.0)
    eng.add(big)
    t += eng.step(t, 1e-4).dt_s
    assert (big.generated, big.booked_left, old.generated) == (1, 988, 1)
    late = Seq(Job(2, t, 5), 5, 5.0)
    eng.add(late)
    t += eng.step(t, 1e-4).dt_s
    assert (big.generated, big.booked_left, old.generated, late.generated) == (2, 476, 1, 0)
    t += eng.step(t, 1e-4).dt_s  # 476 booked, 36 left: the new prompt and the deferred decode
    assert (big.generated, big.booked_left, old.generated, late.generated) == (3, 0, 2, 1)


def test_slai_before_the_fix_paid_prefill_in_iterations() -> None:
    """Our first reading (128 sequences, prefill through the 512-token budget): the same
    prompt's first token waits for its three chunks."""
    reqs = [_req(0.0, 1500, 2)]
    before = simulate(reqs, _on(engine_config("slai").with_(prefill_free=False, max_seqs=128)))
    now = simulate(reqs, "slai")
    assert before.records[0].first_token_s == pytest.approx(0.003)
    assert now.records[0].first_token_s == pytest.approx(0.001)
