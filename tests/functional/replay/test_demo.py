"""`sagesched demo` end to end in a subprocess: table, plot, exit 0, no processes left."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def marked(mark: str) -> list[int]:
    """Live processes whose environment carries `mark` (children inherit it, even the ones
    in their own sessions that a parent-child walk would miss)."""
    needle = f"SAGESCHED_TEST_MARK={mark}".encode()
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                env = Path(f"/proc/{entry}/environ").read_bytes()
            except OSError:
                continue
            if needle in env.split(b"\0"):
                out.append(int(entry))
    return out


def test_demo_prints_the_table_and_leaves_nothing_behind(tmp_path: Path) -> None:
    png = tmp_path / "ttlt.png"
    mark = uuid.uuid4().hex
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "sagesched_cli", "demo", "--png", str(png)],
        capture_output=True, text=True, timeout=360,
        env={**os.environ, "SAGESCHED_TEST_MARK": mark},
    )  # fmt: skip
    elapsed = time.monotonic() - t0
    print(proc.stdout, f"\ndemo wall time {elapsed:.0f} s")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "TTLT mean (s)" in proc.stdout and "sagesched/fcfs" in proc.stdout
    assert png.stat().st_size > 10_000
    assert elapsed < 180
    assert marked(mark) == [], "the demo left processes behind"


def test_marker_scan_sees_a_live_child() -> None:
    mark = uuid.uuid4().hex
    child = subprocess.Popen(["sleep", "30"], env={**os.environ, "SAGESCHED_TEST_MARK": mark})
    try:
        time.sleep(0.2)
        assert marked(mark) == [child.pid]
    finally:
        child.kill()
        child.wait()
