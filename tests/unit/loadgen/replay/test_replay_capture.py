"""The replay's workload from a capture file: `--source capture --path`, `--windows whole`,
the load factor on the recorded gaps, the recorded output lengths, the nearest prompts lined
up with the window cut from the capture."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from gateway.observability.capture import encode_embedding
from loadgen.replay import nearest
from loadgen.replay.cli import _replay_parser, workloads
from loadgen.replay.nearest import NearestPrompts
from loadgen.replay.prompts import PromptRow


@pytest.fixture
def capture(tmp_path: Path) -> Path:
    rows = [(1000.0, 20, 5), (1000.8, 30, 9), (1001.0, 12, 3), (1003.0, 40, 7)]
    lines = [{"v": 1, "arrival_s": t, "model": "m", "prompt_tokens": p, "output_tokens": o,
              "outcome": "completed"} for t, p, o in rows]  # fmt: skip
    for i in (0, 2, 3):  # request i's embedding points at shipped prompt i; request 1 has none
        lines[i]["embedding"] = encode_embedding(np.eye(4)[i] * 0.3)
    lines.insert(2, {"v": 1, "arrival_s": 1000.9, "model": "m", "prompt_tokens": None,
                     "output_tokens": 0, "outcome": "rejected"})  # fmt: skip
    folder = tmp_path / "cap"
    folder.mkdir()
    (folder / "capture-20250101T000000-0001.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in lines)
    )
    return folder


def _workloads(*argv: str) -> list[tuple[str, list]]:  # type: ignore[type-arg]
    return workloads(_replay_parser("replay").parse_args(["--target", "http://x", *argv]))


def test_a_whole_capture_replays_its_gaps_over_the_factor(capture: Path) -> None:
    [(label, reqs)] = _workloads("--source", "capture", "--path", str(capture), "--windows",
                                 "whole", "--factor", "2")  # fmt: skip
    assert label == "capture/capture_whole@x2"
    assert [r.arrival_s for r in reqs] == pytest.approx([0.0, 0.4, 0.5, 1.5])
    assert [(r.prompt_tokens, r.output_tokens) for r in reqs] == [(20, 5), (30, 9), (12, 3),
                                                                  (40, 7)]  # fmt: skip
    assert all(isinstance(r.prompt, list) and len(r.prompt) == r.prompt_tokens for r in reqs)


def test_nearest_prompts_follow_the_window_cut_from_the_capture(
    capture: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = tuple(PromptRow(f"prompt {i}", 10) for i in range(4))
    monkeypatch.setattr(nearest, "shipped_prompts", lambda: NearestPrompts(rows, np.eye(4)))
    path = str(capture)
    [(_, reqs)] = _workloads("--source", "capture", "--path", path, "--windows", "1",
                             "--window-requests", "2", "--factor", "1",
                             "--prompts", "nearest")  # fmt: skip
    # one window of 2 out of 4 requests, at a seeded start: here the last two
    assert [(r.output_tokens, r.prompt) for r in reqs] == [(3, "prompt 2"), (7, "prompt 3")]
    [(_, whole)] = _workloads("--source", "capture", "--path", path, "--windows", "whole",
                              "--factor", "1", "--prompts", "nearest")  # fmt: skip
    assert [r.prompt for r in whole[::2]] == ["prompt 0", "prompt 2"]
    assert isinstance(whole[1].prompt, list) and len(whole[1].prompt) == 30  # no embedding
    assert "3 nearest shipped prompts, 1 synthetic" in capsys.readouterr().err


def test_nearest_needs_a_capture(capture: Path) -> None:
    with pytest.raises(ValueError, match="--prompts nearest needs --source capture"):
        _workloads("--source", "lssp-azure2024", "--prompts", "nearest", "--factor", "1")
    with pytest.raises(ValueError, match="needs --source capture --path"):
        _workloads("--source", "capture", "--prompts", "nearest", "--factor", "1")
