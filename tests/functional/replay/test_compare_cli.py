"""`sagesched replay` and `sagesched compare` as a user runs them, against emulators."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadgen.procs import Children, free_port, sagesched
from loadgen.replay.cli import compare_main
from loadgen.replay.cli import main as replay_main

pytestmark = pytest.mark.slow


@pytest.fixture
def two_emulators(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """A profile-speed emulator and one four times faster."""
    urls = []
    with Children(tmp_path) as children:
        for scale in ("1.0", "0.25"):
            port = free_port()
            cmd = sagesched("emulate", "--port", str(port), "--time-scale", scale)
            children.start(f"emu{scale}", cmd, f"http://127.0.0.1:{port}/health", timeout_s=60)
            urls.append(f"http://127.0.0.1:{port}")
        yield urls[0], urls[1]


def test_compare_reports_the_faster_target(
    two_emulators: tuple[str, str], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    slow, fast = two_emulators
    out = tmp_path / "r.jsonl"
    argv = ["--target", f"slow={slow}", "--target", f"fast={fast}", "--source",
            "lssp-azure2024", "--windows", "1", "--first", "30", "--rate", "5",
            "--max-output", "64", "--max-prompt", "1024", "--json", "--no-progress",
            "--out", str(out)]  # fmt: skip
    assert compare_main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    (runs,) = report.values()
    assert runs["fast"]["e2el_s_mean"] < 0.5 * runs["slow"]["e2el_s_mean"]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 60 and {r["target"] for r in rows} == {"slow", "fast"}
    assert all(r["status"] == "ok" and r["tokens"] == r["output_tokens"] for r in rows)


def test_replay_table_and_exit_codes(
    two_emulators: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    _, fast = two_emulators
    argv = ["--target", fast, "--dataset", "sample", "--num-prompts", "20", "--request-rate",
            "10", "--max-output", "32", "--slo", "e2el:60000", "--no-progress"]  # fmt: skip
    assert replay_main(argv) == 0
    text = capsys.readouterr().out
    assert "Successful requests:" in text and "Request goodput (req/s):" in text
    assert re.search(r"SLO attainment: +1\.000", text), text
    dead = f"http://127.0.0.1:{free_port()}"
    assert replay_main(["--target", dead, "--dataset", "sample", "--no-progress"]) == 2
    assert "sagesched replay:" in capsys.readouterr().err
