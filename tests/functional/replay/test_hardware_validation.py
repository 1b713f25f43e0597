"""`bench/hardware_validation.py` end to end, with an emulated vLLM standing in for the GPU
server: it replays a window straight and through the gateway (FCFS, SageSched; shipped
defaults, so the self-tuning cap), simulates the same requests, reports the validation's checks
and writes the summary and the per-request records."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loadgen.procs import Children, free_port, sagesched

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]
ROOT = Path(__file__).resolve().parents[3]
FIRST = 30


def test_script_validates_an_emulated_server(tmp_path: Path) -> None:
    with Children(tmp_path) as children:
        port = free_port()
        children.start("emulator", sagesched("emulate", "--port", str(port), "--time-scale",
                                             "0.25"),
                       f"http://127.0.0.1:{port}/health", timeout_s=60)  # fmt: skip
        out = tmp_path / "hv"
        cmd = [sys.executable, str(ROOT / "bench" / "hardware_validation.py"),
               "--url", f"http://127.0.0.1:{port}", "--windows", "1", "--first", str(FIRST),
               "--region", "KNEE", "--profile", "cpu-tiny-vllm",
               "--max-num-seqs", "128", "--max-model-len", "2048", "--max-output", "64",
               "--out", str(out)]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=360, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "simulated ratio to direct by cap" in done.stdout  # the simulated comparison's cap
    assert "check gateway-sagesched / gateway-fcfs < 0.95:" in done.stdout
    summary = json.loads((out / "summary.json").read_text())
    [(label, window)] = summary["windows"].items()
    assert label.startswith("lssp-azure2024/") and label.endswith("@KNEE")
    assert window["cap"] in (2, 4, 8, 16, 32, 64, 128)
    assert set(window["measured"]) == set(window["simulated"]) == {
        "direct", "gateway-fcfs", "gateway-sagesched"}  # fmt: skip
    # shipped defaults: the self-tuning cap ran in both gateways, and the checks are reported
    assert set(window["cap_at_end"]) == {"fcfs", "sagesched"}
    assert all(1 <= c <= 1024 for c in window["cap_at_end"].values())
    assert set(window["checks"]) == {
        "gateway-sagesched / direct",
        "gateway-sagesched / gateway-fcfs",
    }
    for arm in window["measured"].values():
        assert arm["successful"] == FIRST and arm["failed"] == 0
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert len(rows) == 3 * FIRST
