"""Mooncake traces: row counts and statistics as SOURCES.md states them, the hash chain."""

from __future__ import annotations

import itertools
import json
import statistics
from pathlib import Path

import pytest

from loadgen.traces import load_requests, shipped_windows
from loadgen.traces.mooncake import MOONCAKE_BLOCK_TOKENS, read_mooncake_jsonl
from policies.routing.chain import chain_ids, shared_blocks


@pytest.mark.parametrize(
    ("source", "rows", "span_s", "mean_in", "mean_out", "reused"),
    [
        ("mooncake-conversation", 12031, 3537, 12035, 343, 0.382),
        ("mooncake-synthetic", 3993, 1022, 15325, 149, 0.659),
    ],
)
def test_mooncake_rows_and_reuse(
    shared: Path,
    source: str,
    rows: int,
    span_s: float,
    mean_in: float,
    mean_out: float,
    reused: float,
) -> None:
    reqs = load_requests(source)
    assert len(reqs) == rows and {r.source for r in reqs} == {source}
    assert reqs[-1].arrival_s == pytest.approx(span_s, abs=1.0)
    assert all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(reqs))
    assert statistics.fmean(r.prompt_tokens for r in reqs) == pytest.approx(mean_in, abs=1)
    assert statistics.fmean(r.output_tokens for r in reqs) == pytest.approx(mean_out, abs=1)
    assert all(r.block_tokens == MOONCAKE_BLOCK_TOKENS for r in reqs)
    assert all(len(r.block_hashes) == r.prompt_tokens // 512 for r in reqs)
    # full prompt blocks whose whole prefix an earlier request had (one unbounded cache);
    # SOURCES.md's 36.6 % / 64.0 % count the partial last blocks too
    seen: set[int] = set()
    hits = total = 0
    for r in reqs:
        hits += sum(h in seen for h in r.block_hashes)
        total += len(r.block_hashes)
        seen.update(r.block_hashes)
    assert hits / total == pytest.approx(reused, abs=0.001)


def test_hash_ids_become_a_chain_of_full_blocks(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]},
        {"timestamp": 1500, "input_length": 1024, "output_length": 7, "hash_ids": [0, 1]},
        {"timestamp": 2000, "input_length": 600, "output_length": 1, "hash_ids": [0, 9]},
        {"timestamp": 2500, "input_length": 2048, "output_length": 1, "hash_ids": [5, 1, 2, 3]},
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    a, b, c, d = read_mooncake_jsonl(path, "mooncake-test")
    assert (b.arrival_s, b.prompt_tokens, b.output_tokens) == (1.5, 1024, 7)
    assert a.block_hashes == chain_ids([0, 1])  # 1100 tokens: two full blocks
    assert b.block_hashes == a.block_hashes and len(c.block_hashes) == 1
    assert shared_blocks(a.block_hashes, c.block_hashes) == 1
    assert shared_blocks(a.block_hashes, d.block_hashes) == 0  # same ids 1, 2 after another 0


def test_missing_field_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 5}\n')
    with pytest.raises(ValueError, match=r"t\.jsonl:1: missing field"):
        read_mooncake_jsonl(path, "x")


@pytest.mark.parametrize("source", ["mooncake-conversation", "mooncake-synthetic"])
def test_frozen_window_keeps_the_hashes(source: str) -> None:
    (window,) = shipped_windows(source)
    assert len(window) == 200 and window.requests[0].arrival_s == 0.0
    assert all(len(r.block_hashes) == r.prompt_tokens // 512 for r in window.requests)
    assert any(
        shared_blocks(a.block_hashes, b.block_hashes)
        for a, b in itertools.combinations(window.requests[:50], 2)
    )
