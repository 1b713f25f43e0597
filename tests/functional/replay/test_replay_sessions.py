"""`sagesched replay --sessions`: real multi-turn conversations through the `openai` client
against an emulator with prefix caching; each turn resends the history, so later turns are
longer and the engine's prefix cache hits them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadgen.procs import Children, free_port, sagesched
from loadgen.replay.cli import main as replay_main
from loadgen.replay.sessions import SESSION_HEADER, build_sessions
from loadgen.vllm_real import prefix_cache_counters

pytestmark = pytest.mark.slow


@pytest.fixture
def emulator(tmp_path: Path) -> Iterator[str]:
    with Children(tmp_path) as children:
        port = free_port()
        cmd = sagesched("emulate", "--port", str(port), "--time-scale", "0.25")
        children.start("emu", cmd, f"http://127.0.0.1:{port}/health", timeout_s=60)
        yield f"http://127.0.0.1:{port}"


def test_sessions_replay_each_turn_with_its_history(
    emulator: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "turns.jsonl"
    argv = ["--target", emulator, "--sessions", "mt-bench", "--num-sessions", "6",
            "--session-rate", "10", "--think-median", "0.05", "--think-max", "0.2",
            "--max-output", "16", "--json", "--no-progress", "--out", str(out)]  # fmt: skip
    assert replay_main(argv) == 0
    (report,) = json.loads(capsys.readouterr().out).values()
    turns = report["by_turn"]
    assert set(turns) == {"1", "2"} and turns["1"]["turns"] == turns["2"]["turns"] == 6
    assert turns["2"]["prompt_tokens_mean"] > 2 * turns["1"]["prompt_tokens_mean"]
    assert report["summary"]["successful"] == 12 and report["failures"] == {}
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(r["status"] == "ok" and r["tokens"] == r["output_tokens"] for r in rows)
    queries, hits = prefix_cache_counters(
        emulator
    )  # turn 2 starts with turn 1's prompt, cached by then
    assert queries > 0 and hits >= 6 * 16  # at least a 16-token block per session


def test_sessions_are_seeded_and_carry_their_key() -> None:
    a = build_sessions("mt-bench", 5, 2.0, seed=3, max_output=32)
    b = build_sessions("mt-bench", 5, 2.0, seed=3, max_output=32)
    assert [s.turns for s in a] == [s.turns for s in b] and len({s.key for s in a}) == 5
    for s in a:
        first, second = s.turns
        assert first.messages is not None and second.messages is not None
        assert second.messages[: len(first.messages)] == first.messages
        assert second.messages[len(first.messages)]["role"] == "assistant"
        assert first.headers == second.headers == {SESSION_HEADER: s.key}
        assert s.thinks_s[0] == 0.0 and s.thinks_s[1] > 0 and first.output_tokens <= 32
    assert [s.start_s for s in a] == sorted(s.start_s for s in a) and a[0].start_s == 0.0
    with pytest.raises(ValueError, match="only 30 usable"):
        build_sessions("mt-bench", 31, 2.0)
