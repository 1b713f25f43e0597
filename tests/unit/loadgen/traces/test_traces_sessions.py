"""Chat sessions from ShareGPT and MT-Bench: prompts that extend each other, real token ids,
Poisson session starts, think-time follow-ups, and the documented think-time fit."""

from __future__ import annotations

import csv
import gzip
import itertools
import math
import statistics
from pathlib import Path

import numpy as np
import pytest

from loadgen.traces.sessions import (
    ThinkTime,
    conversations,
    session_workload,
    token_ids,
    turn_prompts,
)
from policies.routing.chain import chain_tokens, shared_blocks


def test_token_ids_are_the_bundled_bert_tokenizer() -> None:
    assert token_ids(["Hello world", "user:"]) == [[7592, 2088], [5310, 1024]]


def test_each_turn_extends_the_previous_prompt(shared: Path) -> None:
    conv = conversations("mt-bench")[0]
    (p1, o1), (p2, o2) = turn_prompts(conv)
    assert p2[: len(p1)] == p1 and len(p2) > len(p1) + o1 // 2
    assert o1 == len(token_ids([conv[0][1]])[0]) and o2 >= 1
    assert shared_blocks(chain_tokens(p1, 16), chain_tokens(p2, 16)) == len(p1) // 16


def test_datasets(shared: Path) -> None:
    assert len(conversations("mt-bench")) == 30  # the questions with recorded answers
    assert all(len(c) == 2 for c in conversations("mt-bench"))
    sharegpt = conversations("sharegpt")
    assert len(sharegpt) > 10_000 and max(map(len, sharegpt)) > 10
    with pytest.raises(ValueError, match="unknown session dataset"):
        conversations("alpaca")  # type: ignore[arg-type]


def test_workload_marks_later_turns_with_their_think_time(shared: Path) -> None:
    reqs = session_workload("sharegpt", 40, 0.5, block_tokens=32, seed=3)
    by: dict[str, list] = {}
    for r in reqs:
        by.setdefault(r.session or "", []).append(r)
    assert len(by) == 40 and {r.source for r in reqs} == {"sessions-sharegpt"}
    assert all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(reqs))
    for turns in by.values():
        assert turns[0].think_s is None
        assert all(r.think_s is not None and r.think_s > 0 for r in turns[1:])
        for a, b in itertools.pairwise(turns):
            assert b.arrival_s == pytest.approx(a.arrival_s + (b.think_s or 0.0))
            assert shared_blocks(a.block_hashes, b.block_hashes) == a.prompt_tokens // 32
        assert all(r.block_tokens == 32 and len(r.block_hashes) == r.prompt_tokens // 32
                   for r in turns)  # fmt: skip
    assert reqs == session_workload("sharegpt", 40, 0.5, block_tokens=32, seed=3)
    assert reqs != session_workload("sharegpt", 40, 0.5, block_tokens=32, seed=4)


def test_sessions_start_as_a_poisson_process(shared: Path) -> None:
    reqs = session_workload("mt-bench", 3000, 4.0, max_turns=1)
    starts = sorted(r.arrival_s for r in reqs)
    gaps = np.diff(starts)
    assert starts[0] == 0.0 and len(starts) == 3000
    assert gaps.mean() == pytest.approx(0.25, rel=0.06)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.08)  # exponential: CV 1


def test_context_limit_ends_a_session(shared: Path) -> None:
    reqs = session_workload("sharegpt", 60, 1.0, max_context_tokens=2048)
    assert reqs and all(r.prompt_tokens + r.output_tokens <= 2048 for r in reqs)


def test_think_time_sampling() -> None:
    rng = np.random.default_rng(0)
    draws = ThinkTime(median_s=10.0, sigma=1.0, max_s=50.0).sample(rng, 20_000)
    assert float(np.median(draws)) == pytest.approx(10.0, rel=0.05) and draws.max() == 50.0


def test_default_think_time_is_the_burstgpt_v3_fit(shared: Path) -> None:
    """The documented default: log-normal over BurstGPT v3's within-session gaps."""
    path = shared / "traces" / "burstgpt" / "burstgpt3_slice.csv.gz"
    with gzip.open(path, "rt") as f:
        rows = [r for r in csv.DictReader(f) if r["Session ID"]]
    by: dict[str, list[dict[str, str]]] = {}
    for r in rows:
        by.setdefault(r["Session ID"], []).append(r)
    logs = []
    for turns in by.values():
        turns.sort(key=lambda r: float(r["Timestamp"]))
        for a, b in itertools.pairwise(turns):
            gap = float(b["Timestamp"]) - float(a["Timestamp"]) - float(a["Elapsed time"])
            logs.append(math.log(gap))
    assert len(logs) == 259
    assert math.exp(statistics.fmean(logs)) == pytest.approx(ThinkTime().median_s, abs=0.1)
    assert statistics.stdev(logs) == pytest.approx(ThinkTime().sigma, abs=0.01)
