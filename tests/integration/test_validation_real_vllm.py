"""Real-engine validation: the same window straight at the vLLM CPU build and through the
gateway with SageSched (slow; one real server per session).

The window (LSSP Azure-2024 window 0, first 80 requests, prompts capped at 1,800 tokens and
outputs at 128) is replayed with real ShareGPT prompts padded to the trace's prompt lengths
(exact, through vLLM's /tokenize), at load factor 1.0 (80 requests in 3.75 s), so a backlog
forms: straight at vLLM, through the gateway (its own process, SageSched, in-flight cap 4,
predictor warmed on the shipped sample), and straight at vLLM again. The
measured ratio and the simulator's prediction for the same requests (`cpu-tiny-vllm`) are
written to `.cache/validation.json` and recorded in docs/validation.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import pytest

from loadgen.demo.procs import Children, free_port, sagesched
from loadgen.demo.run import ONE_THREAD, gateway_config, write_warm_set
from loadgen.replay.cli import run
from loadgen.replay.client import ReplayRequest
from loadgen.replay.prompts import build_requests, synthetic_window, tokenize_counter
from loadgen.replay.validation import measured_gain, simulated_gain, window_trace
from loadgen.vllm_real import CACHE, RealVllm

pytestmark = [pytest.mark.slow, pytest.mark.perf_real, pytest.mark.timeout(900)]


def tagged(reqs: list[ReplayRequest], tag: str) -> list[ReplayRequest]:
    """The requests with `tag` in front of each prompt (one more token or two)."""
    return [dataclasses.replace(r, prompt=f"{tag} {r.prompt}") for r in reqs]


CAP = 4
WINDOW = {"source": "lssp-azure2024", "window": 0, "n": 80, "max_prompt": 1800,
          "max_output": 128, "factor": 1.0}  # fmt: skip


def test_gateway_sagesched_beats_vllm_alone(real_vllm: RealVllm, tmp_path: Path) -> None:
    t_start = time.monotonic()
    count = tokenize_counter(real_vllm.url, real_vllm.name)
    assert count is not None, "vLLM's /tokenize is missing"
    trace = window_trace(**WINDOW)  # type: ignore[arg-type]
    reqs = build_requests(trace, prompts="sample", count_tokens=count, pad=True)
    assert sum(r.prompt_tokens == t.prompt_tokens for r, t in zip(reqs, trace, strict=True)) >= 70
    # a fresh vLLM CPU server is slow on its first batch shapes: warm it up first
    warm = build_requests(synthetic_window(n=30, rate_per_s=6.0, seed=98), prompts="ids")
    run(real_vllm.url, real_vllm.name, warm, progress=False)
    load = os.getloadavg()[0]
    # Direct, gateway, direct again (the machine's speed drifts with the other load; the
    # gateway is compared with both direct runs together). Each run's prompts start with their
    # own tag, so vLLM's prefix cache never serves one run's prefill from an earlier run's.
    direct = run(real_vllm.url, real_vllm.name, tagged(reqs, "alpha"), progress=False)
    with Children(tmp_path) as children:
        port = free_port()
        warm_set = tmp_path / "warm.jsonl"
        write_warm_set([], warm_set, holdout=False)
        cfg = gateway_config(tmp_path / "gw.yaml", port, real_vllm.url, "sagesched", CAP,
                             warm_set)  # fmt: skip
        children.start("gateway", sagesched("serve", "--config", str(cfg)),
                       f"http://127.0.0.1:{port}/ready", 240, env=ONE_THREAD)  # fmt: skip
        via = run(f"http://127.0.0.1:{port}", real_vllm.name, tagged(reqs, "beta"),
                  progress=False)  # fmt: skip
    direct += run(real_vllm.url, real_vllm.name, tagged(reqs, "gamma"), progress=False)
    measured = measured_gain(direct, via)
    simulated = simulated_gain(reqs, "cpu-tiny-vllm", CAP)
    result = {
        "window": WINDOW,
        "gateway": {"policy": "sagesched", "max_inflight": CAP, "warm": "sample (400 prompts)"},
        "load_average_1m": load,
        "measured": measured,
        "simulated_cpu_tiny_vllm": simulated,
        "gain_measured": 1 - measured["ratio"],
        "gain_simulated": 1 - simulated["ratio"],
        "wall_s": round(time.monotonic() - t_start, 1),
    }
    (CACHE / "validation.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    assert measured["direct_failed"] == 0 and measured["gateway_failed"] == 0
    # Client, gateway and vLLM share this machine's two cores; the gateway's embeddings can
    # starve the client (schedule lag up to ~1.7 s seen), which the from-scheduled TTLT charges
    # to the gateway. The claim is checked without the client's lag; both ratios are reported.
    assert measured["ratio_from_send"] < 1.0, f"gateway mean TTLT not below vLLM's: {measured}"
