"""Restart keeps what was learned, and nothing ever touches the network.

One subprocess (a fresh interpreter, as after a restart) runs with a socket guard that makes
every non-loopback connect and name lookup fail and records it, and with no Hugging Face
environment variables set, so the predictor's own offline switches are what is tested.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from predictor import Embedder, LengthPredictor, PredictorConfig

REPO = Path(__file__).resolve().parents[3]
PROMPTS = [
    "Write a haiku about autumn leaves.",
    "Explain in depth how TCP congestion control works, with examples.",
    "What is the capital of Peru?",
]

CHILD = Path(__file__).with_name("offline_child.py")


@pytest.fixture(scope="module")
def restarted(embedder: Embedder, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Learn, save, then predict in a new guarded process; returns both sides' answers."""
    cfg = PredictorConfig(capacity_items=500, min_neighbours=2, global_window_items=100)
    model = LengthPredictor(cfg, embedder=embedder)
    model.observe_many(PROMPTS, [30, 900, 12], [8, 14, 7])
    model.observe("Write a haiku about winter snow.", 28, 8)
    path = tmp_path_factory.mktemp("snap") / "history.npz"
    model.save(path)
    expected = [model.predict(p, prompt_tokens=10) for p in PROMPTS]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    proc = subprocess.run(
        [sys.executable, str(CHILD), str(path), json.dumps(PROMPTS)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    child: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"expected": expected, "child": child}


@pytest.mark.slow
def test_restart_keeps_what_was_learned(restarted: dict[str, Any]) -> None:
    child = restarted["child"]
    assert child["items"] == 4
    for want, (support, probs) in zip(restarted["expected"], child["dists"], strict=True):
        assert np.allclose(want.support, support) and np.allclose(want.probs, probs)
    # it did learn the long answer: from four examples the blend of neighbours and ridge puts
    # the TCP question well above the others (its median stays low: one long example of four)
    means = [d.mean() for d in restarted["expected"]]
    assert means[1] > 1.5 * max(means[0], means[2])


@pytest.mark.slow
def test_no_network_access(restarted: dict[str, Any]) -> None:
    child = restarted["child"]
    assert child["guard_ok"] is True
    assert child["blocked"] == []
    assert child["offline"] == "1"
    assert child["ntok"] == 2  # the tokenizer also loaded offline
    assert child["backend"] == PredictorConfig().embed_backend  # the serving path, ONNX
