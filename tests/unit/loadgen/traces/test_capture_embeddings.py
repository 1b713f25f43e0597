"""Prompt embeddings in a capture: the gateway's int8 encoding decodes within its error bound;
records without one decode to None; `capture_embeddings` lines up with `read_capture`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gateway.observability.capture import encode_embedding
from loadgen.traces.capture import (
    capture_embeddings,
    capture_summary,
    decode_embedding,
    read_capture,
)


def test_round_trip_is_within_half_a_step() -> None:
    rng = np.random.default_rng(7)
    for _ in range(20):
        vec = rng.normal(size=384).astype(np.float32)
        vec /= np.linalg.norm(vec)  # as MiniLM's: unit length
        enc = encode_embedding(vec)
        assert enc is not None
        back = decode_embedding({"embedding": enc})
        assert back is not None and back.dtype == np.float32 and back.shape == (384,)
        step = np.abs(vec).max() / 127
        assert np.abs(back - vec).max() <= step / 2 + 1e-7
        assert float(back @ vec / np.linalg.norm(back)) > 0.999  # cosine barely moves
    assert np.all(decode_embedding({"embedding": encode_embedding(np.zeros(4))}) == 0)


def test_records_without_an_embedding_decode_to_none() -> None:
    assert decode_embedding({"arrival_s": 1.0, "outcome": "completed"}) is None
    assert decode_embedding({"embedding": None}) is None
    with pytest.raises(ValueError, match="not a capture embedding"):
        decode_embedding({"embedding": {"int8": "not base64!", "scale": 0.1}})


def _rec(t: float, out: int, outcome: str = "completed", vec: Any = None) -> dict[str, Any]:
    r: dict[str, Any] = {"v": 1, "arrival_s": t, "model": "m", "prompt_tokens": 10,
                         "output_tokens": out, "outcome": outcome}  # fmt: skip
    if vec is not None:
        r["embedding"] = encode_embedding(vec)
    return r


def test_embeddings_line_up_with_the_completed_requests(tmp_path: Path) -> None:
    a, b = np.array([0.6, 0.8], np.float32), np.array([-1.0, 0.0], np.float32)
    lines = [
        _rec(5.0, 3, vec=a),
        _rec(2.0, 4),
        _rec(3.0, 0, "rejected", vec=b),
        _rec(4.0, 5, vec=b),
    ]
    path = tmp_path / "capture-x.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    trace = read_capture(path, "capture")
    vecs = capture_embeddings(path)
    assert [r.output_tokens for r in trace] == [4, 5, 3]  # arrival order, completed only
    assert vecs[0] is None
    assert vecs[1] is not None and np.allclose(vecs[1], b, atol=1 / 127)
    assert vecs[2] is not None and np.allclose(vecs[2], a, atol=1 / 127)
    assert capture_summary(path)["with_embedding"] == 3
