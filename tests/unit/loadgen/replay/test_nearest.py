"""`loadgen.replay.nearest`: cosine-nearest shipped prompt per captured embedding, synthetic
prompts of the recorded length where a record has none, the embeddings' cache."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from loadgen.replay.nearest import NearestPrompts, nearest_requests, shipped_prompts
from loadgen.replay.prompts import PromptRow
from loadgen.schema import TraceRequest

ROWS = (PromptRow("about cats", 50, 3), PromptRow("about dogs", 200, 4), PromptRow("tax law", 9))
VECS = np.array([[1.0, 0.0, 0.0], [0.6, 0.8, 0.0], [0.0, 0.0, 1.0]], np.float32)


def test_nearest_is_the_highest_cosine() -> None:
    prompts = NearestPrompts(ROWS, VECS)
    queries = [np.array([5.0, 0.5, 0.0]), None, np.array([0.5, 0.9, 0.1]), np.array([0, 0.1, 0.2])]
    assert prompts.nearest(queries) == [ROWS[0], None, ROWS[1], ROWS[2]]  # length ignored
    assert prompts.nearest([None, None]) == [None, None]
    with pytest.raises(ValueError, match="another embedding model"):
        prompts.nearest([np.ones(5)])


def test_requests_fall_back_to_synthetic_prompts_of_the_recorded_length() -> None:
    trace = [TraceRequest(0.0, 30, 7, "capture"), TraceRequest(0.5, 12, 40, "capture"),
             TraceRequest(2.0, 8, 5, "capture", deadline_s=9.0)]  # fmt: skip
    vecs = [np.array([0.0, 1.0, 0.1], np.float32), None, np.array([0.0, 0.1, 1.0], np.float32)]
    reqs, fell_back = nearest_requests(trace, vecs, NearestPrompts(ROWS, VECS), max_output=20)
    assert fell_back == 1
    assert [r.prompt for r in reqs][::2] == ["about dogs", "tax law"]
    synthetic = reqs[1].prompt
    assert isinstance(synthetic, list) and len(synthetic) == reqs[1].prompt_tokens == 12
    assert [r.prompt_tokens for r in reqs][::2] == [4, 8]  # the row's count, else the trace's
    assert [r.output_tokens for r in reqs] == [7, 20, 5]  # recorded, capped at max_output
    assert [(r.arrival_s, r.deadline_s) for r in reqs] == [(0.0, None), (0.5, None), (2.0, 9.0)]
    with pytest.raises(ValueError, match="3 requests but 2 embeddings"):
        nearest_requests(trace, vecs[:2], NearestPrompts(ROWS, VECS))


class _FakeEmbedder:
    """Counts forward passes; embeds a text as its (length, vowels, 1) direction."""

    backend = "fake"
    path = Path("/models/fake-minilm")

    def __init__(self) -> None:
        self.calls = 0

    def encode(self, texts: Any) -> Any:
        self.calls += 1
        return np.array([[len(t), sum(c in "aeiou" for c in t), 1.0] for t in texts], np.float32)


def test_shipped_embeddings_are_cached(tmp_path: Path) -> None:
    fake = _FakeEmbedder()
    first = shipped_prompts(ROWS, embedder=fake, cache_dir=tmp_path)  # type: ignore[arg-type]
    again = shipped_prompts(ROWS, embedder=fake, cache_dir=tmp_path)  # type: ignore[arg-type]
    assert fake.calls == 1 and len(list(tmp_path.glob("prompts-*.npy"))) == 1
    assert np.array_equal(first.vectors, again.vectors) and again.rows == ROWS
    assert np.allclose(np.linalg.norm(first.vectors, axis=1), 1.0)
    shipped_prompts(ROWS[:2], embedder=fake, cache_dir=tmp_path)  # type: ignore[arg-type]
    assert fake.calls == 2  # other texts: another cache entry
