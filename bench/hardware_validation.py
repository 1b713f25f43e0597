"""Validate SageSched on your own vLLM server (GPU), end to end, given its URL.

For each selected trace window at the chosen load region this script
1. replays the window straight at the server (vLLM's own FCFS scheduling);
2. starts the gateway locally (`sagesched serve`, in its own process group) with FCFS and then
   with SageSched, both with the same in-flight cap, and replays the same window through each;
3. runs the simulator on exactly the requests that were sent (direct vLLM, gateway FCFS,
   gateway SageSched) with the latency profile you name;
4. prints measured and simulated mean-TTLT ratios side by side and writes everything to
   `--out` (JSON summary + per-request JSONL).

See docs/hardware-validation.md for the procedure. Example:

    .venv/bin/python bench/hardware_validation.py --url http://gpu-host:8000 \\
        --source lssp-azure2024 --windows 3 --region KNEE --cap 32 --profile h200-llama3-8b
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from loadgen.engine.configs import engine_config
from loadgen.engine.profiles import profile_names
from loadgen.regions import REGIONS, compress, region_factor
from loadgen.replay.cli import run, served_model, write_jsonl
from loadgen.replay.client import ReplayRequest, ReplayResult
from loadgen.replay.prompts import build_requests, tokenize_counter
from loadgen.replay.report import comparison, summarize_replay
from loadgen.replay.validation import GatewayArm, recommend_cap, simulated_ttlt, through_gateway
from loadgen.schema import TraceRequest
from loadgen.sim.cli import _windows


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="the vLLM server's base URL")
    p.add_argument("--model", help="served model (default: the server's first)")
    p.add_argument("--source", default="lssp-azure2024")
    p.add_argument("--windows", default="3", help="'all', a count N or ids a,b")
    p.add_argument("--region", default="KNEE", choices=list(REGIONS))
    p.add_argument("--rate-scale", type=float, default=1.0, help="extra factor on the load")
    p.add_argument("--first", type=int, help="only the first N requests of each window")
    p.add_argument("--cap", default="default",
                   help="'default': the shipped defaults (self-tuning cap); N: a fixed cap; "
                        "'auto': per window, the fixed cap the simulator finds best for "
                        "SageSched (2, 4, ..., 128)")  # fmt: skip
    p.add_argument("--max-model-len", type=int, default=8192, help="the server's limit")
    p.add_argument("--max-output", type=int, help="cap output lengths (tokens)")
    p.add_argument("--profile", default="h200-llama3-8b", choices=profile_names())
    p.add_argument("--engine", default="vllm-chunked-prefill", help="simulated engine config")
    p.add_argument("--max-num-seqs", type=int, default=256, help="the server's --max-num-seqs")
    p.add_argument("--policies", default="fcfs,sagesched", help="gateway policies to run")
    p.add_argument("--out", default="hardware-validation", help="output folder")
    return p


def requests_for(trace: list[TraceRequest], url: str, model: str, args: argparse.Namespace
                 ) -> list[ReplayRequest]:  # fmt: skip
    """Real prompts padded to the trace's lengths where /tokenize exists, else token ids."""
    out_cap = args.max_output or args.max_model_len
    trace = [
        dataclasses.replace(r, output_tokens=min(r.output_tokens, out_cap),
                            prompt_tokens=min(r.prompt_tokens, args.max_model_len - out_cap - 8))
        for r in trace
    ]  # fmt: skip
    count = tokenize_counter(url, model)
    if count is None:
        print("no /tokenize: token-id prompts (the gateway's predictor sees no text)")
        return build_requests(trace, prompts="ids")
    return build_requests(trace, prompts="sample", count_tokens=count, pad=True)


def simulated_engine(args: argparse.Namespace) -> Any:
    return engine_config(args.engine).with_(max_seqs=args.max_num_seqs)


def cap_for(reqs: list[ReplayRequest], args: argparse.Namespace) -> int:
    """`--cap N`, or (`auto`, `default`) the simulator's best cap for these requests: the
    gateway's fixed cap with `auto`, only the simulated comparison's with `default`."""
    if args.cap not in ("auto", "default"):
        return int(args.cap)
    caps = (2, 4, 8, 16, 32, 64, 128)
    cap, sweep = recommend_cap(reqs, args.profile, caps, simulated_engine(args))
    print("simulated ratio to direct by cap: "
          + ", ".join(f"{c}: {r:.3f}" for c, r in sweep.items()) + f" -> cap {cap}")  # fmt: skip
    return cap


def simulated(reqs: list[ReplayRequest], args: argparse.Namespace, cap: int) -> dict[str, float]:
    arms: dict[str, tuple[str, int | None]] = {"direct": ("fcfs", None)}
    arms |= {f"gateway-{p}": (p, cap) for p in _policies(args)}
    return simulated_ttlt(reqs, args.profile, arms, simulated_engine(args))


CHECKS = (("gateway-sagesched", "direct", 0.8), ("gateway-sagesched", "gateway-fcfs", 0.95))
"""(arm, baseline, bound on their mean-TTLT ratio): the real-vLLM validation's targets
(issue 15; docs/validation.md)."""


def _checks(summaries: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """`arm / baseline` → (mean-TTLT ratio, bound), for each check whose arms ran."""
    return {
        f"{arm} / {base}": (summaries[arm]["e2el_s_mean"] / summaries[base]["e2el_s_mean"], bound)
        for arm, base, bound in CHECKS
        if arm in summaries and base in summaries
    }


def _policies(args: argparse.Namespace) -> list[str]:
    return [p.strip() for p in args.policies.split(",") if p.strip()]


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = args.model or served_model(args.url)
    report: dict[str, Any] = {"args": vars(args), "windows": {}}
    for w in _windows(args.source, args.windows):
        trace = list(w.requests[: args.first] if args.first else w.requests)
        factor = region_factor(w, args.region) * args.rate_scale
        reqs = requests_for(compress(trace, factor), args.url, model, args)
        label = f"{w.source}/{w.window_id}@{args.region}"
        cap = cap_for(reqs, args)
        results: dict[str, list[ReplayResult]] = {}
        end_caps: dict[str, int] = {}
        results["direct"] = run(args.url, model, reqs, desc=f"direct {label}")
        shipped = args.cap == "default"
        for policy in _policies(args):
            arm = GatewayArm(policy) if shipped else GatewayArm(policy, cap, adaptive=False)
            print(f"{policy} {label} ...", flush=True)
            with tempfile.TemporaryDirectory() as tmp:
                results[f"gateway-{policy}"], end_caps[policy], _ = through_gateway(
                    args.url, model, reqs, arm, Path(tmp)
                )
        for name, rs in results.items():
            write_jsonl(str(out_dir / "requests.jsonl"), label, name, rs)
        summaries = {n: summarize_replay(rs) for n, rs in results.items()}
        sim = simulated(reqs, args, cap)
        how = f"self-tuning cap, at the end {end_caps}" if shipped else f"cap {cap}"
        print(f"\n== {label} (load factor {factor:.3g}, {len(reqs)} requests, {how})")
        print(comparison(summaries))
        print(f"{'mean TTLT ratio':<28}{'measured':>10}{'simulated':>11}")
        for name in summaries:
            m = summaries[name]["e2el_s_mean"] / summaries["direct"]["e2el_s_mean"]
            s = sim[name] / sim["direct"]
            print(f"{name + ' / direct':<28}{m:>10.3f}{s:>11.3f}")
        checks = _checks(summaries)
        for name, (value, bound) in checks.items():
            print(f"check {name} < {bound}: {value:.3f} {'pass' if value < bound else 'FAIL'}")
        report["windows"][label] = {"factor": factor, "cap": cap, "cap_at_end": end_caps,
                                    "measured": summaries, "simulated": sim,
                                    "checks": checks}  # fmt: skip
    (out_dir / "summary.json").write_text(json.dumps(report, indent=1, default=str))
    print(f"\nwritten: {out_dir}/summary.json, {out_dir}/requests.jsonl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
