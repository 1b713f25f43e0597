"""The engine model's prefix cache: hits, the last-token rule, eviction order, reference
counts, recompute after preemption, vLLM's counters, and no change without hashes."""

from __future__ import annotations

import pytest
from fixtures.prefix_prompts import VLLM_MEASURED, conversations, model_counters, send_order
from hypothesis import given, settings
from hypothesis import strategies as st

from loadgen.engine.configs import EngineConfig, engine_config
from loadgen.engine.model import Engine, Seq
from loadgen.engine.profiles import make_profile
from loadgen.sim.simulator import Contender, simulate
from loadgen.traces import shipped_windows
from policies.job import Job
from policies.registry import parse_policy
from policies.routing.chain import chain_ids

BT = 16


def _engine(kv_blocks: int = 1000, **changes: object) -> Engine:
    cfg = EngineConfig(
        "t", "test", block_tokens=BT, kv_tokens=kv_blocks * BT, watermark_fraction=0.0
    ).with_(**changes)
    return Engine(cfg, make_profile("lssp-constant"))


def _seq(i: int, prompt: int, ids: list[int], out: int = 2, hash_tokens: int = BT) -> Seq:
    return Seq(Job(i, 0.0, prompt), out, out, hashes=chain_ids(ids), hash_tokens=hash_tokens)


def _run(engine: Engine, *seqs: Seq) -> float:
    """Add `seqs` and step until the engine is empty; returns the end time."""
    t = 0.0
    for s in seqs:
        engine.add(s)
    for _ in range(10_000):
        if not engine:
            return t
        t += engine.step(t, 1.0).dt_s
    raise AssertionError("the engine did not drain")


def _step_until(engine: Engine, done: object, t: float = 0.0) -> float:
    """Step one iteration at a time until `done()` holds (bounded)."""
    for _ in range(10_000):
        if done():  # type: ignore[operator]
            return t
        t += engine.step(t, 0.0).dt_s
    raise AssertionError("condition never held")


def test_second_request_computes_only_after_its_cached_prefix() -> None:
    e = _engine()
    _run(e, _seq(0, 100, [1, 2, 3, 4, 5, 6]))  # 6 full blocks of 16
    s = _seq(1, 100, [1, 2, 3, 9, 9, 9])  # shares 3 blocks
    e.add(s)
    e.step(0.0, 0.0)
    assert s.cached >= 3 and e.prefix_cache_hits == 3 * BT
    assert e.prefix_cache_queries == 200


def test_a_fully_cached_prompt_recomputes_its_last_block() -> None:
    e = _engine()
    _run(e, _seq(0, 64, [1, 2, 3, 4]))  # exactly 4 blocks
    _run(e, _seq(1, 64, [1, 2, 3, 4]))
    assert e.prefix_cache_hits == 3 * BT  # at most prompt - 1 tokens hit
    _run(e, _seq(2, 65, [1, 2, 3, 4]))
    assert e.prefix_cache_hits == 3 * BT + 4 * BT


def test_hit_shortens_prefill_time() -> None:
    prof = make_profile("h200-llama3-8b")
    cfg = engine_config("vllm-fcfs")
    ids = list(range(200))
    times = []
    for warm in (False, True):
        e = Engine(cfg, prof)
        if warm:
            _run(e, _seq(0, 3200, ids))
        s = _seq(1, 3200, ids)
        e.add(s)
        times.append(e.step(0.0, 0.0).dt_s)
    assert times[1] < 0.5 * times[0]


def test_entries_span_several_engine_blocks() -> None:
    e = _engine()
    _run(e, _seq(0, 1100, [1, 2], hash_tokens=512))
    _run(e, _seq(1, 1100, [1, 7], hash_tokens=512))
    assert e.prefix_cache_hits == 512
    with pytest.raises(ValueError, match="not a multiple"):
        e.add(_seq(2, 100, [1], hash_tokens=24))


def test_a_chain_past_the_prompt_caches_the_generated_blocks() -> None:
    e = _engine()
    first = _seq(0, 64, list(range(8)), out=40)  # chain of 8 blocks: 4 prompt + 4 output
    _run(e, first)
    assert e.cache is not None and first.cached == 0
    assert len(e.cache.refs) == 6  # 64 + 40 tokens in KV: 6 full blocks
    _run(e, _seq(1, 128, list(range(8))))
    assert e.prefix_cache_hits == 6 * BT


def test_uncached_free_blocks_go_before_any_eviction() -> None:
    e = _engine(kv_blocks=20)
    _run(e, _seq(0, 64, [1, 2, 3, 4], out=1))  # leaves 4 cached blocks, 16 uncached free
    assert e.cache is not None and e.cache.lru_blocks == 4
    _run(e, Seq(Job(1, 0.0, 200), 1, 1))  # 13 blocks, no hashes: fits in the uncached ones
    assert e.cache.evictions == 0
    _run(e, _seq(2, 64, [1, 2, 3, 4]))
    assert e.prefix_cache_hits == 3 * BT


def test_eviction_is_least_recently_freed_first() -> None:
    e = _engine(kv_blocks=12)
    _run(e, _seq(0, 64, [10, 11, 12, 13], out=1))  # A: 4 cached blocks
    _run(e, _seq(1, 64, [20, 21, 22, 23], out=1))  # B: 4 cached blocks, freed after A
    _run(e, _seq(2, 64, [10, 11, 12, 13], out=1))  # A again: touched, now freed after B
    _run(e, Seq(Job(3, 0.0, 100), 1, 1))  # 7 blocks: 4 uncached free, then 3 evicted
    assert e.cache is not None and e.cache.evictions == 3
    hits = e.prefix_cache_hits
    _run(e, _seq(4, 65, [10, 11, 12, 13]))  # A survived whole
    assert e.prefix_cache_hits - hits == 4 * BT
    hits = e.prefix_cache_hits
    _run(e, _seq(5, 65, [20, 21, 22, 23]))  # B lost its tail first, then the rest
    assert e.prefix_cache_hits - hits == BT


def test_shared_blocks_are_held_once_and_counted_once() -> None:
    e = _engine()
    a, b = _seq(0, 100, [1, 2, 3, 4, 5, 6], out=50), _seq(1, 100, [1, 2, 3, 4, 5, 6], out=5)
    e.add(a)
    e.step(0.0, 0.0)  # a computes its prompt and registers 6 entries
    e.add(b)
    t = e.step(0.0, 0.0).dt_s
    assert e.cache is not None
    assert all(e.cache.refs[h] == 2 for h in a.hashes)
    used = e.capacity - e.free_blocks
    assert used == a.blocks + b.blocks - 6  # the six shared blocks once
    while b in e.running:
        t += e.step(t, 0.0).dt_s
    assert all(e.cache.refs[h] == 1 for h in a.hashes) and e.cache.lru_blocks >= 0
    assert not any(h in e.cache.lru for h in a.hashes)  # still held by a: not evictable


def test_preempted_sequence_recomputes_and_hits_its_own_blocks() -> None:
    """Preempted (the last admitted), it waits; its prompt blocks stay cached behind its
    generated ones (evicted first), and its recompute finds all six again."""
    e = _engine(kv_blocks=27)
    other = Seq(Job(1, 0.0, 10), 200, 200)  # 13 blocks in all
    s = _seq(0, 96, [1, 2, 3, 4, 5, 6], out=300)  # 25 blocks in all
    e.add(other)
    e.add(s)
    t = _step_until(e, lambda: s.preemptions == 1)
    queries, hits = e.prefix_cache_queries, e.prefix_cache_hits
    assert s.cached == 0 and s in e.waiting
    _step_until(e, lambda: s in e.running, t)
    assert s.cached == 6 and e.cache is not None and e.cache.evictions == 0
    assert (e.prefix_cache_queries, e.prefix_cache_hits) == (queries, hits)  # not counted


def test_counters_off_and_on() -> None:
    off = _engine(prefix_caching=False)
    _run(off, _seq(0, 64, [1, 2, 3, 4]), _seq(1, 64, [1, 2, 3, 4]))
    assert off.cache is None and off.prefix_cache_queries == off.prefix_cache_hits == 0
    on = _engine()
    _run(on, Seq(Job(0, 0.0, 64), 1, 1))
    assert on.prefix_cache_queries == 64 and on.prefix_cache_hits == 0  # no hashes: no hits


def test_matches_the_counters_vllm_reported() -> None:
    """The real-vLLM test's prompts: the model gives exactly vLLM's (queries, hits)."""
    prompts = send_order(conversations())
    for kv_blocks, measured in VLLM_MEASURED.items():
        assert model_counters(prompts, kv_blocks) == measured


@pytest.mark.parametrize("engine", ["vllm-fcfs", "vllm-chunked-prefill", "sarathi"])
def test_results_without_hashes_are_unchanged(engine: str) -> None:
    window = shipped_windows("azure-conv-2023")[0]
    runs = []
    for on in (False, True):
        cfg = engine_config(engine).with_(prefix_caching=on, kv_tokens=40_000)
        c = Contender("fcfs", parse_policy("fcfs"), cfg, None)
        res = simulate(window.requests, c, "h200-llama3-8b")
        runs.append([(r.first_token_s, r.finish_s, r.preemptions) for r in res.records])
    assert runs[0] == runs[1]


@pytest.mark.timeout(120)
@settings(max_examples=25, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.integers(1, 12), st.integers(0, 40), st.integers(1, 60)),
        min_size=1,
        max_size=25,
    ),
    st.integers(12, 60),
)
def test_kv_accounting_with_sharing(reqs: list[tuple[int, int, int, int]], kv_blocks: int) -> None:
    """Free + physically held blocks = capacity after every step, through sharing, eviction
    and preemption; every request finishes; the cache's free share is within the free blocks."""
    e = _engine(kv_blocks=kv_blocks, max_batch_tokens=256)
    seqs = []
    for i, (family, blocks, tail, out) in enumerate(reqs):
        ids = [family * 100 + k for k in range(blocks)]
        seqs.append(_seq(i, min(blocks * BT + tail, (kv_blocks - 2) * BT - out), ids, out))
        e.add(seqs[-1])
    t, steps = 0.0, 0
    while e and steps < 20_000:
        res = e.step(t, 0.0)
        t, steps = t + res.dt_s, steps + 1
        cache = e.cache
        assert cache is not None and 0 <= cache.lru_blocks <= e.free_blocks
        held = sum(s.blocks - s.cached * (s.hash_tokens // BT) for s in [*e.running, *e.waiting])
        entries = sum(1 for r in cache.refs.values() if r > 0)
        assert held + entries + e.free_blocks == e.capacity
    assert not e and all(s.generated == s.output for s in seqs)
