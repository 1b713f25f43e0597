"""The gating real-engine tests, N times back to back: pass count and margins.

Each run is `pytest -m timing` in its own process, exactly as `make test` runs it first (one
vLLM CPU server pinned to the engine CPUs, nothing else alive): the emulator's fidelity
(median over 3 pairs of emulator/vLLM median TTFT and TTLT, asserted within 30%), the
gateway's gain (gateway-SageSched / vLLM-alone mean TTLT over 3 rounds: the one-sided 95%
upper bound of its mean asserted below 1, its median against the 0.8 target; each round's
ratio and the caps at its end are recorded) and the self-tuning cap against the emulator.
After each run this reads what the tests wrote (`.cache/emulator-fidelity.json`,
`.cache/validation.json`), prints one row, and appends it to `.cache/gating-runs.jsonl`.
The last line is the pass count and how often the 0.8 target was met.

Run: `.venv/bin/python bench/gating_runs.py [--runs 10] [--isa avx2]` (about 11 minutes a
run; needs `make vllm-env`). `--isa avx2` runs vLLM as on a CPU without AVX-512, the other
machine kind (`RealVllm(isa=...)`). Keep the machine otherwise idle: that is what the gate
assumes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from loadgen.vllm_real import CACHE, ISAS, ROOT

FIDELITY = CACHE / "emulator-fidelity.json"
VALIDATION = CACHE / "validation.json"
TOLERANCE = 0.30
BOUND = 1.0
"""The validation test's bound on the upper 95% bound of SageSched / vLLM alone."""
TARGET = 0.8
"""The median SageSched / vLLM alone aimed for."""
COLUMNS = ("run", "pytest", "s", "kind", "TTFT", "TTLT", "margin", "S/direct (rounds)", "upper95",
           "margin", "F/direct", "S/F", "scale", "cap")  # fmt: skip


def one_run(i: int, isa: str = "native") -> dict[str, Any]:
    """One `pytest -m timing` process; what it measured."""
    for f in (FIDELITY, VALIDATION):
        f.unlink(missing_ok=True)
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "timing", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT, capture_output=True, text=True, env={**os.environ, "SAGESCHED_VLLM_ISA": isa},
    )  # fmt: skip
    row: dict[str, Any] = {"run": i, "rc": proc.returncode, "s": round(time.monotonic() - t0)}
    row["summary"] = (proc.stdout.strip().splitlines() or [""])[-1]
    row["failed"] = [ln.split()[1] for ln in proc.stdout.splitlines() if ln.startswith("FAILED")]
    if FIDELITY.exists():
        fid = json.loads(FIDELITY.read_text())
        row["fidelity"] = fid["ratio"]
        row["time_scales"] = [fid["fit"]["time_scale"]]
        row["kind"] = "other" if fid.get("balance", {}).get("prefill_ratio", 1) >= 1.5 else "ref"
    if VALIDATION.exists():
        val = json.loads(VALIDATION.read_text())
        row["validation"] = val["median"]
        row["upper95"] = val.get("sagesched_over_direct_upper95", float("nan"))
        row["cap"] = [r["cap_at_end"] for r in val["rounds"]]
        row["rounds"] = [r["sagesched_over_direct"] for r in val["rounds"]]
        # each round's cap over time per arm ((seconds, cap) pairs): why a round ended where it did
        row["cap_traces"] = [r.get("caps", {}) for r in val["rounds"]]
    return row


def line(row: dict[str, Any]) -> str:
    fid, val = row.get("fidelity", {}), row.get("validation", {})
    ttft, ttlt = fid.get("ttft_ms", float("nan")), fid.get("ttlt_ms", float("nan"))
    fid_margin = TOLERANCE - max(abs(ttft - 1), abs(ttlt - 1))
    s_d = val.get("sagesched_over_direct", float("nan"))
    rounds = "/".join(f"{x:.2f}" for x in row.get("rounds", []))
    upper = row.get("upper95", float("nan"))
    scales = row.get("time_scales", [])
    cells = [row["run"], "pass" if row["rc"] == 0 else f"FAIL ({row['rc']})", row["s"],
             row.get("kind", ""), f"{ttft:.2f}", f"{ttlt:.2f}", f"{fid_margin:+.2f}",
             f"{s_d:.3f} ({rounds})", f"{upper:.3f}", f"{BOUND - upper:+.3f}",
             f"{val.get('fcfs_over_direct', float('nan')):.3f}",
             f"{val.get('sagesched_over_fcfs', float('nan')):.3f}",
             "/".join(f"{x:.2f}" for x in scales), row.get("cap", "")]  # fmt: skip
    return "| " + " | ".join(str(c) for c in cells) + " |"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--out", type=Path, default=CACHE / "gating-runs.jsonl")
    ap.add_argument("--isa", choices=ISAS, default="native", help="vLLM's instruction set")
    args = ap.parse_args(argv)
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS), flush=True)
    passed = met = 0
    for i in range(1, args.runs + 1):
        row = one_run(i, args.isa)
        passed += row["rc"] == 0
        met += row.get("validation", {}).get("sagesched_over_direct", math.inf) <= TARGET
        with args.out.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(line(row), flush=True)
    print(f"{passed} passed, {args.runs - passed} failed; median S/direct <= {TARGET} in {met}")
    return 0 if passed == args.runs else 1


if __name__ == "__main__":
    raise SystemExit(main())
