"""Prompt synthesis and matching, arrivals."""

from __future__ import annotations

import itertools
import random
import re

import pytest

from loadgen.replay.prompts import (
    PromptRow,
    arrivals,
    build_requests,
    dataset_requests,
    exact_text,
    load_prompt_rows,
    match_prompts,
    synthetic_window,
)
from loadgen.schema import TraceRequest


def fake_tokenizer(text: str) -> int:
    """BOS + one token per word, two for words longer than three letters."""
    return 1 + sum(1 if len(w) <= 3 else 2 for w in re.findall(r"\w+", text))


@pytest.mark.parametrize("n", [1, 2, 7, 64, 500])
def test_exact_text_hits_the_count(n: int) -> None:
    text = exact_text(n, fake_tokenizer)
    if n == 1:  # BOS alone cannot be reached with at least one word
        assert text is None
    else:
        assert text is not None and fake_tokenizer(text) == n


def test_build_requests_text_falls_back_to_ids_and_keeps_lengths() -> None:
    trace = [TraceRequest(0.5 * i, 10 + i, 5 + i, "t", deadline_s=9.0) for i in range(4)]
    text = build_requests(trace, prompts="text", count_tokens=fake_tokenizer, max_output=6)
    assert all(isinstance(r.prompt, str) and fake_tokenizer(r.prompt) == r.prompt_tokens
               for r in text)  # fmt: skip
    assert [r.output_tokens for r in text] == [5, 6, 6, 6]
    ids = build_requests(trace, prompts="text", count_tokens=None)
    assert [len(r.prompt) for r in ids] == [10, 11, 12, 13]
    assert [r.arrival_s for r in ids] == [0.0, 0.5, 1.0, 1.5]
    assert all(r.deadline_s == 9.0 for r in ids)


def test_match_prompts_picks_closest_lengths_without_reuse() -> None:
    rows = [PromptRow(f"p{n}", n) for n in (10, 100, 1000)]
    got = match_prompts([90, 11, 5000, 100], rows)
    assert [r.output_tokens for r in got[:3]] == [100, 10, 1000]
    assert got[3].output_tokens in (10, 100, 1000)  # pool exhausted: refilled


def test_frozen_sample_ships_and_matches() -> None:
    rows = load_prompt_rows("sample")
    assert len(rows) == 400 and all(r.prompt and r.output_tokens > 0 for r in rows)
    reqs = build_requests(synthetic_window(n=50, seed=3), prompts="sample")
    assert all(isinstance(r.prompt, str) for r in reqs)
    assert len({r.prompt for r in reqs}) == 50


def test_arrivals_rate_and_burstiness() -> None:
    for shape in (1.0, 0.25):
        t = arrivals(4000, 20.0, burstiness=shape, seed=2)
        assert t == sorted(t)
        assert 3999 / (t[-1] - t[0]) == pytest.approx(20.0, rel=0.1)
    gaps = [b - a for a, b in itertools.pairwise(t)]
    mean = sum(gaps) / len(gaps)
    cv2 = sum((g - mean) ** 2 for g in gaps) / len(gaps) / mean**2
    assert cv2 == pytest.approx(4.0, rel=0.25)  # gamma shape k: CV² = 1/k
    with pytest.raises(ValueError):
        arrivals(3, 0.0)


def test_dataset_requests_use_the_rows_lengths() -> None:
    reqs = dataset_requests(20, 5.0, max_output=50, seed=random.Random(1).randrange(9))
    rows = {r.prompt: r.output_tokens for r in load_prompt_rows()}
    assert all(r.output_tokens == min(rows[str(r.prompt)], 50) for r in reqs)


def test_pad_real_prompts_to_the_trace_length() -> None:
    trace = [TraceRequest(0.0, 600, 20, "t"), TraceRequest(1.0, 2, 20, "t"),
             TraceRequest(2.0, 8, 20, "t")]  # fmt: skip
    reqs = build_requests(trace, prompts="sample", count_tokens=fake_tokenizer, pad=True)
    long, short, cut = reqs
    assert isinstance(long.prompt, str) and fake_tokenizer(long.prompt) == 600
    assert long.prompt_tokens == 600
    row = {r.output_tokens: r.prompt for r in load_prompt_rows()}
    assert any(long.prompt.startswith(p) for p in row.values())  # the real text comes first
    assert isinstance(short.prompt, str) and short.prompt_tokens == fake_tokenizer(short.prompt)
    # a real prompt longer than the trace's is cut to its leading words, then padded
    assert short.prompt_tokens == 2
    assert isinstance(cut.prompt, str) and fake_tokenizer(cut.prompt) == cut.prompt_tokens == 8
    assert any(p.startswith(cut.prompt.split(" ")[0] + " ") for p in row.values())
