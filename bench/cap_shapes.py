"""The real-engine validation's window in simulation, on the machine kind a validation run
measured: what the self-tuning cap leaves of SageSched's order next to fixed caps.

    python bench/cap_shapes.py [--validation .cache/validation.json]

The window is `loadgen.replay.validation.LIVE_WINDOW` (80 requests of LSSP Azure-2024 in
3.75 s) replayed as the validation test replays it on that machine (`MachineShape.window`:
arrivals and prompts reshaped by the run's fitted `shape`), on the `vllm-chunked-prefill`
engine with `CpuTinyVllm(shape.k)`; without `--validation` (or on the reference kind) the
committed `cpu-tiny-vllm` coefficients. Beliefs log-normal around the true length (sigma
0.5; the simulator's fixed draw, so a run is deterministic). Arms: vLLM alone; gateway
SageSched and FCFS behind fixed caps; both behind the shipped self-tuning cap from a cold start
at 8, and from the curve two learning replays left (as the test starts its measured gateways).
Prints one table of mean TTLT ratios (SageSched / vLLM alone, FCFS / vLLM alone, SageSched /
FCFS at the same cap logic) and the time-averaged cap.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from cap_bursts import ttlt  # noqa: E402

from loadgen.engine.configs import engine_config  # noqa: E402
from loadgen.engine.fit_cpu import MachineShape  # noqa: E402
from loadgen.engine.profiles import CpuTinyCoefficients, CpuTinyVllm  # noqa: E402
from loadgen.replay.validation import LIVE_WINDOW, window_trace  # noqa: E402
from loadgen.schema import TraceRequest  # noqa: E402
from loadgen.sim.simulator import Contender, SimResult, simulate  # noqa: E402
from policies.capacity import CapLaw  # noqa: E402
from policies.registry import parse_policy  # noqa: E402

FIXED = (4, 8, 16, 32)
START_CAP = 8
LEARNING_REPLAYS = 2


def machine(validation: Path | None) -> MachineShape:
    """The shape a validation run recorded, or the reference kind's."""
    if validation is None:
        return MachineShape()
    shape = json.loads(validation.read_text())["shape"]
    return MachineShape(CpuTinyCoefficients(**shape["k"]), shape["stretch"], shape["shrink"])


def run(
    trace: list[TraceRequest],
    shape: MachineShape,
    policy: str,
    cap: int | None,
    *,
    tuned: bool = False,
    memory: dict[str, Any] | None = None,
) -> SimResult:
    c = Contender(policy, parse_policy(policy), engine_config("vllm-chunked-prefill"), cap,
                  cap_law=CapLaw() if tuned else None, cap_memory=memory)  # fmt: skip
    return simulate(trace, c, CpuTinyVllm(shape.k), belief_sigma=0.5)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--validation", type=Path, help="a validation run's record (its shape)")
    args = ap.parse_args()
    shape = machine(args.validation)
    trace = shape.window(window_trace(**LIVE_WINDOW))  # type: ignore[arg-type]
    rows: dict[str, tuple[float, float, float, float]] = {}
    direct = ttlt(run(trace, shape, "fcfs", None))

    def add(name: str, s: SimResult, f: SimResult) -> None:
        cap = statistics.fmean(x.extra.get("cap_mean", float("nan")) for x in (s, f))
        rows[name] = (ttlt(s) / direct, ttlt(f) / direct, ttlt(s) / ttlt(f), cap)

    for cap in FIXED:
        add(f"fixed cap {cap}", run(trace, shape, "sagesched", cap),
            run(trace, shape, "fcfs", cap))  # fmt: skip
    add("self-tuning, cold", run(trace, shape, "sagesched", START_CAP, tuned=True),
        run(trace, shape, "fcfs", START_CAP, tuned=True))  # fmt: skip
    memory = None
    for _ in range(LEARNING_REPLAYS):
        memory = run(trace, shape, "fcfs", START_CAP, tuned=True, memory=memory).cap_memory
    add("self-tuning, from the learnt curve",
        run(trace, shape, "sagesched", START_CAP, tuned=True, memory=memory),
        run(trace, shape, "fcfs", START_CAP, tuned=True, memory=memory))  # fmt: skip
    kind = "reference" if args.validation is None else f"shape of {args.validation}"
    print(f"the validation window on the {kind} "
          f"(arrivals × {shape.stretch:.2f}, prompts ÷ {shape.shrink:.2f})")  # fmt: skip
    head = ("gateway cap", "SageSched / vLLM alone", "FCFS / vLLM alone", "SageSched / FCFS",
            "mean cap")  # fmt: skip
    print("| " + " | ".join(head) + " |")
    print("|---|---:|---:|---:|---:|")
    for name, (s, f, sf, cap) in rows.items():
        mean_cap = "–" if math.isnan(cap) else f"{cap:.1f}"
        print(f"| {name} | {s:.3f} | {f:.3f} | {sf:.3f} | {mean_cap} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
