"""Session turns in the simulator: a later turn arrives its think time after the previous
turn's last token; the prefix cache makes re-sent conversations cheaper."""

from __future__ import annotations

import pytest

from loadgen.engine.configs import engine_config
from loadgen.schema import TraceRequest
from loadgen.sim.replicas import Replicas, simulate_replicas
from loadgen.sim.simulator import Contender, engine_chains, follow_ups, simulate
from policies.registry import parse_policy
from policies.routing.chain import chain_ids


def _fcfs(engine: str = "vllm-chunked-prefill", **changes: object) -> Contender:
    return Contender("fcfs", parse_policy("fcfs"), engine_config(engine).with_(**changes), None)


def _turn(t: float, prompt: int, out: int, session: str, think: float | None, blocks: int
          ) -> TraceRequest:  # fmt: skip
    return TraceRequest(t, prompt, out, "test", session=session, think_s=think,
                        block_hashes=chain_ids(range(blocks)), block_tokens=16)  # fmt: skip


def test_next_turn_arrives_think_time_after_the_previous_ends() -> None:
    reqs = [
        _turn(0.0, 800, 50, "a", None, 50),
        _turn(0.5, 60, 5, "b", None, 3),
        _turn(2.0, 1600, 20, "a", 2.0, 100),  # estimate 2.0 s; really 2 s after turn 1 ends
        _turn(9.0, 1700, 20, "a", 0.25, 106),
    ]
    res = simulate(reqs, _fcfs(), "h200-llama3-8b")
    r = res.records
    assert r[0].finish_s is not None and r[2].finish_s is not None
    assert r[2].arrival_s == pytest.approx(r[0].finish_s + 2.0)
    assert r[3].arrival_s == pytest.approx(r[2].finish_s + 0.25)
    assert all(x.finish_s is not None for x in r)
    # b shares 3 blocks with a; turns 2 and 3 find turns 1 and 2 cached with their answers:
    # 800 + 50 tokens = 53 full blocks of turn 2's chain, 1600 + 20 = 101 of turn 3's
    assert res.extra["prefix_cache_hits"] == 16 * (3 + 53 + 101)


def test_engine_chains_extend_over_the_answer_only_when_the_next_turn_resends_it() -> None:
    reqs = [
        _turn(0.0, 800, 50, "a", None, 50),
        _turn(1.0, 1600, 20, "a", 1.0, 100),
        _turn(2.0, 100, 5, "c", None, 6),
        _turn(3.0, 200, 5, "c", 1.0, 0),  # another chain: no extension
    ]
    reqs[3] = TraceRequest(3.0, 200, 5, "test", session="c", think_s=1.0,
                           block_hashes=chain_ids(range(7, 19)), block_tokens=16)  # fmt: skip
    chains = engine_chains(reqs)
    assert chains[0] == reqs[1].block_hashes[:53] and chains[1] == reqs[1].block_hashes
    assert chains[2] == reqs[2].block_hashes and chains[3] == reqs[3].block_hashes


def test_prefix_caching_shortens_later_turns() -> None:
    reqs = [_turn(0.0, 4000, 10, "a", None, 250), _turn(1.0, 4100, 10, "a", 1.0, 256)]
    ttft = []
    for on in (False, True):
        rec = simulate(reqs, _fcfs(prefix_caching=on), "h200-llama3-8b").records[1]
        assert rec.first_token_s is not None
        ttft.append(rec.first_token_s - rec.arrival_s)
    assert ttft[1] < 0.5 * ttft[0]


def test_a_dropped_turn_still_releases_the_next_and_the_cut_off_drops_it() -> None:
    reqs = [_turn(0.0, 100, 10_000, "a", None, 6), _turn(1.0, 200, 5, "a", 1.0, 12)]
    res = simulate(reqs, _fcfs(drain_s=1.0), "h200-llama3-8b")
    assert res.records[0].dropped and res.records[1].dropped
    assert res.records[1].first_token_s is None


def test_follow_ups_need_an_earlier_turn_of_their_session() -> None:
    ok = [_turn(0, 10, 1, "a", None, 0), _turn(0, 10, 1, "b", None, 0), _turn(1, 10, 1, "a", 1, 0)]
    assert follow_ups(ok) == {0: (2, 1.0)}
    with pytest.raises(ValueError, match="follows a turn"):
        follow_ups([_turn(0, 10, 1, "a", 1.0, 0)])


def test_replicas_refuse_follow_ups() -> None:
    reqs = [_turn(0, 10, 1, "a", None, 0), _turn(1, 10, 1, "a", 1.0, 0)]
    with pytest.raises(ValueError, match="simulate"):
        simulate_replicas(reqs, _fcfs(), "h200-llama3-8b", Replicas())
