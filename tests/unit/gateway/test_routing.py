"""The gateway routes through `policies.routing`: the configured router, its prefix chain of
a request (character blocks, token ids), per-model routers, the engine's state it is shown,
and the `routing:` setting."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.cli import build_parser, overrides
from gateway.config import AdaptiveCapConfig, ConfigError, build, load
from gateway.observability.metrics import GatewayMetrics
from gateway.scheduling.backends import BackendPool
from gateway.scheduling.routing import ID_BLOCK_TOKENS, request_prefix, session_key
from gateway.serving.openai_api import parse_call
from gateway.workers import wire
from policies import Job
from policies.capacity import EngineSample
from policies.routing import parse_router
from policies.routing.chain import TEXT_BLOCK_TOKENS, shared_blocks

SYSTEM = {"role": "system", "content": "You answer questions about the sea. " * 4}


def chat(*turns: str) -> dict[str, Any]:
    """A conversation's body: user turns, each but the last followed by its recorded answer."""
    messages: list[dict[str, str]] = [SYSTEM]
    for i, turn in enumerate(turns):
        messages.append({"role": "user", "content": turn})
        if i < len(turns) - 1:
            messages.append({"role": "assistant", "content": f"answer {i}: " + "waves " * 30})
    return {"model": "m", "messages": messages}


def test_a_conversations_next_turn_starts_with_its_previous_turns_blocks() -> None:
    first, first_tokens = request_prefix(parse_call("chat", chat("how deep is it?" * 5)))
    second, _ = request_prefix(parse_call("chat", chat("how deep is it?" * 5, "and wide?")))
    alone = {"role": "user", "content": "how deep is it?" * 20}  # no system prompt
    other, _ = request_prefix(parse_call("chat", {"model": "m", "messages": [alone]}))
    assert first_tokens == TEXT_BLOCK_TOKENS and len(second) > len(first) >= 3
    assert len(other) >= 3
    assert shared_blocks(first, second) == len(first)
    assert shared_blocks(first, other) == 0


def test_token_id_prompts_chain_their_ids_and_batches_chain_nothing() -> None:
    ids = list(range(100, 180))
    chain, block = request_prefix(parse_call("completions", {"model": "m", "prompt": ids}))
    assert block == ID_BLOCK_TOKENS and len(chain) == 80 // ID_BLOCK_TOKENS
    batch = parse_call("completions", {"model": "m", "prompt": ["a" * 200, "b" * 200]})
    assert request_prefix(batch) == ((), 0)
    assert request_prefix(parse_call("completions", {"model": "m", "prompt": "short"})) == ((), 0)


def test_session_header() -> None:
    assert session_key(None) is None and session_key("  ") is None
    assert session_key(" conv-1 ") == "conv-1" and len(session_key("x" * 1000) or "") == 256


def test_routing_setting_default_flag_env_and_bad_spec() -> None:
    assert build({"backends": [{"url": "http://b:8000"}]}).routing == "sagesched"
    args = build_parser("serve").parse_args(
        ["--backend", "http://b:8000", "--routing", "prefix:prefix_weight=2"]
    )
    assert load(None, overrides(args), {}).routing == "prefix:prefix_weight=2"
    env = {"SAGESCHED_ROUTING": "least-loaded", "SAGESCHED_BACKENDS": "http://b:8000"}
    assert load(None, {}, env).routing == "least-loaded"
    with pytest.raises(ConfigError, match="routing: unknown router 'nearest'"):
        build({"backends": [{"url": "http://b:8000"}], "routing": "nearest"})
    with pytest.raises(ConfigError, match="routing:"):
        build({"backends": [{"url": "http://b:8000"}], "routing": "prefix:no_such=1"})


def _job(i: int, body: dict[str, Any]) -> Job:
    prefix, block = request_prefix(parse_call("chat", body))
    return Job(id=i, arrival_s=0.0, prompt_tokens=400, prefix=prefix, block_tokens=block)


async def _pool(session: aiohttp.ClientSession, routing: str, n: int = 2) -> BackendPool:
    cfg = build({"backends": [{"url": f"http://b{i}:8000", "max_inflight": 4} for i in range(n)]})
    pool = BackendPool(cfg.backends, session, health_interval_s=60.0,
                       adaptive=AdaptiveCapConfig(enabled=False),
                       router=parse_router(routing))  # fmt: skip
    for b in pool.backends:
        b.healthy, b.models = True, frozenset({"m", "other"})
    return pool


@pytest.mark.parametrize(("routing", "sticks"), [("prefix", True), ("sagesched", True),
                                                 ("least-loaded", False)])  # fmt: skip
async def test_a_conversation_follows_its_cached_prefix(routing: str, sticks: bool) -> None:
    async with aiohttp.ClientSession() as session:
        pool = await _pool(session, routing)
        turn1 = _job(1, chat("how deep is the sea? " * 40))
        first = pool.pick("m", job=turn1)
        assert first is not None
        pool.acquire(first)
        pool.routed("m", turn1, first)
        pool.release(first, "m", turn1)  # turn 1 ends; turn 2 comes while another request
        pool.acquire(first)  # runs there and the other backend is idle
        turn2 = _job(2, chat("how deep is the sea? " * 40, "and how wide?"))
        second = pool.pick("m", job=turn2)
        assert second is not None
        assert (second is first) == sticks
        pool.acquire(second)
        pool.routed("m", turn2, second)
        if sticks:  # the router expects turn 1's blocks there, and the time cost skips them
            assert turn2.cached_tokens == len(turn1.prefix) * TEXT_BLOCK_TOKENS
        # another model's router has its own index: nothing of "m" is cached for it
        other = _job(3, chat("how deep is the sea? " * 40, "and how wide?"))
        assert pool.pick("other", job=other) is not None
        pool.routed("other", other, pool.backends[0])
        assert other.cached_tokens == 0
        pool.release(second, "m", turn2)
        assert second.inflight == (1 if sticks else 0)  # the other request still runs


async def test_decisions_are_counted_by_reason_with_the_tokens_expected_cached() -> None:
    async with aiohttp.ClientSession() as session:
        pool = await _pool(session, "prefix")
        metrics = GatewayMetrics()
        metrics.watch(pool, None)  # type: ignore[arg-type]
        history = "how deep is the sea? " * 40
        turns = [_job(1, chat(history)), _job(2, chat(history, "and how wide?"))]
        where = []
        for job in turns:
            b = pool.pick("m", job=job)
            assert b is not None
            pool.acquire(b)
            pool.routed("m", job, b)
            where.append(b.name)
        short = Job(id=3, arrival_s=0.0, prompt_tokens=5)  # no full block: nothing to match
        b = pool.pick("m", job=short)  # the idle backend
        assert b is not None
        pool.routed("m", short, b)
        b0, b1 = (x.name for x in pool.backends)
        assert where == [b0, b0]  # turn 2 follows turn 1 (still running) for its prefix
        assert pool.decisions == {("m", b0, "fallback"): 1, ("m", b0, "affinity"): 1,
                                  ("m", b1, "fallback"): 1}  # fmt: skip
        assert pool.cached_tokens[("m", b0)] == turns[1].cached_tokens > 0
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(metrics.exposition()[0].decode())
            for s in family.samples
        }
        labels = (("backend", b0), ("model", "m"), ("reason", "affinity"), ("router", "prefix"))
        assert samples[("sagesched_routing_decisions_total", labels)] == 1.0
        tokens = [
            v for (n, _), v in samples.items() if n == "sagesched_routing_prompt_tokens_total"
        ]
        assert sum(tokens) == 400 + 400 + 5


async def test_the_router_sees_the_engines_queue_and_kv_from_the_last_scrape() -> None:
    async with aiohttp.ClientSession() as session:
        pool = await _pool(session, "least-loaded")
        b = pool.backends[0]
        assert b.state().kv_blocks is None and b.state().waiting is None
        b.observed(EngineSample(waiting=3.0, kv_usage=0.5, kv_capacity_tokens=160_000.0))
        b.inflight = 2
        state = b.state()
        assert (state.name, state.inflight, state.cap, state.serving) == (b.name, 2, 4, True)
        assert (state.waiting, state.kv_usage, state.kv_blocks) == (3, 0.5, 10_000)
        assert pool.routing == "least-loaded"


def test_a_workers_job_carries_its_chain_and_session_to_the_authority() -> None:
    job = _job(1, chat("how deep is the sea? " * 40))
    job.session = "conv-7"
    job.ctx = _Ctx()
    fields = wire.unpack(wire.pack({"op": "admit", **wire.job_fields(job)}))
    assert tuple(fields["prefix"]) == job.prefix and fields["block_tokens"] == TEXT_BLOCK_TOKENS
    assert fields["session"] == "conv-7"


class _Ctx:
    """The parts of a gateway `Ticket` `wire.job_fields` reads."""

    def __init__(self) -> None:
        self.call = parse_call("chat", chat("x"))
        self.klass = type("K", (), {"name": "default"})()


async def test_a_workers_pool_view_knows_which_engines_report_their_cache() -> None:
    """With `--workers N` the authority pushes each backend's KV-event block size (while its
    events are exact), so a worker's tokenizer call makes the prompt's token chain."""
    from gateway.workers.remote import RemotePool

    cfg = build({"backends": [{"url": "http://b0:8000"}, {"url": "http://b1:8000"}]})
    async with aiohttp.ClientSession() as session:
        view = RemotePool(cfg.backends, session, cfg)
        row = {"healthy": True, "models": ["m"], "cards": [], "cap": 4, "inflight": 0}
        view.apply([{**row, "name": "b0:8000", "event_block": None},
                    {**row, "name": "b1:8000", "event_block": 128}])  # fmt: skip
        assert view.event_block_size("m") == 128 and view.event_block_size("other") is None
        view.apply([{**row, "name": "b0:8000"}, {**row, "name": "b1:8000"}])
        assert view.event_block_size("m") is None
