"""`sagesched demo`: FCFS vs SageSched behind the gateway, on an emulated backend.

On a fresh machine with no GPU and no network: starts `sagesched emulate` (the
`cpu-tiny-vllm` profile, time-scaled), then the gateway with FCFS and replays a frozen trace
window through it, then the gateway with SageSched (its predictor warmed from the shipped
prompt sample) and replays the same window; prints one comparison table and writes a PNG of
the TTLT distributions. With the self-tuning cap (the default), a first replay through an
FCFS gateway lets the cap learn the backend's curve, and both measured gateways start from
that memory, as a gateway restarted in front of a known backend does. Every child runs in its
own process group and is stopped on exit.

The workload: the arrival times of a frozen LSSP Azure-2024 window, output lengths from the
trace (capped), real ShareGPT prompts from `loadgen/data/prompts/` matched to those lengths,
so the gateway's semantic predictor sees real text. The predictor is warmed on the whole
sample, the replayed prompts included (a long-running gateway's history of recurring prompts;
an upper bound on what prediction buys); `--holdout` warms it on the other rows only. The
load makes a backlog at the gateway's in-flight cap: `loadgen.regions.factor_for_utilisation`
at `--utilisation` (default 1.6, past the knee) of an engine limited to `--cap` requests.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from loadgen.procs import Children, free_port, sagesched
from loadgen.replay.client import ReplayRequest, ReplayResult
from loadgen.replay.prompts import build_requests, load_prompt_rows
from loadgen.replay.report import comparison, failures, summarize_replay, warnings_for

SOURCE = "lssp-azure2024"
PROFILE = "cpu-tiny-vllm"
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def workload(
    n: int, max_output: int, utilisation: float, cap: int | None, seed: int = 0
) -> tuple[list[ReplayRequest], float]:
    """The demo window's first `n` requests at the demo load, and the load factor used.

    `utilisation` is offered decode work over the token capacity of the emulated engine with
    `cap` sequences (None: its full batch, where its throughput saturates)."""
    from loadgen.engine.configs import engine_config
    from loadgen.regions import compress, factor_for_utilisation
    from loadgen.traces import shipped_windows

    window = shipped_windows(SOURCE)[0]
    trace = [r for r in window.requests[:n]]
    capped = [min(r.output_tokens, max_output) for r in trace]
    import dataclasses

    trace = [dataclasses.replace(r, output_tokens=o) for r, o in zip(trace, capped, strict=True)]
    engine = engine_config("vllm-chunked-prefill")
    if cap is not None:
        engine = engine.with_(max_seqs=cap)
    factor = factor_for_utilisation(trace, utilisation, engine=engine, profile=PROFILE)
    return build_requests(compress(trace, factor), prompts="sample", seed=seed), factor


def write_warm_set(requests: Sequence[ReplayRequest], path: Path, holdout: bool) -> int:
    """The sample (without the replayed prompts if `holdout`) as the predictor's warm-start
    JSONL; returns the count."""
    used = {r.prompt for r in requests} if holdout else set()
    rows = [r for r in load_prompt_rows("sample") if r.prompt not in used]
    with path.open("w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps({"prompt": r.prompt, "output_tokens": r.output_tokens}) + "\n")
    return len(rows)


def gateway_config(path: Path, port: int, backend: str, policy: str, cap: int | None,
                   warm: Path | None, *, adaptive: bool = True, priority: bool = False,
                   capture: Path | None = None,
                   cap_memory: Path | None = None) -> Path:  # fmt: skip
    """A `sagesched serve --config` file: one backend, the predictor (if the policy needs
    one) warm-started from the JSONL `warm` (may be gzipped). `cap`: the backend's
    `max_inflight` (None: the shipped default), where the self-tuning cap starts, or the fixed
    cap with `adaptive=False`. `priority`: the backend runs vLLM priority scheduling.
    `capture`: the folder the gateway records its traffic to (`serve --capture`).
    `cap_memory`: the file the self-tuning cap remembers its fitted curve in."""
    import yaml

    backend_cfg: dict[str, object] = {"url": backend}
    if cap is not None:
        backend_cfg["max_inflight"] = cap
    if priority:
        backend_cfg["priority_scheduling"] = True
    cfg: dict[str, object] = {
        "port": port,
        "policy": policy,
        "backends": [backend_cfg],
        "log_level": "WARNING",
        "health_interval_s": 0.5,
    }
    if not adaptive:
        cfg["adaptive_cap"] = {"enabled": False}
    elif cap_memory is not None:
        cfg["adaptive_cap"] = {"memory_path": str(cap_memory)}
    if capture is not None:
        cfg["capture"] = {"dir": str(capture)}
    if warm is not None:
        # loaded only if the policy asks for predictions (FCFS starts without torch)
        cfg["predictor"] = {"warm_start_jsonl": str(warm)}
    path.write_text(yaml.safe_dump(cfg))
    return path


def plot(results: dict[str, list[ReplayResult]], path: Path, title: str) -> None:
    """Empirical CDFs of TTLT per policy (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, rs in results.items():
        v = np.sort([r.ttlt_s for r in rs if r.ok])
        if v.size:
            ax.step(v, np.arange(1, v.size + 1) / v.size, where="post",
                    label=f"{name} (mean {v.mean():.2f} s)")  # fmt: skip
    ax.set_xscale("log")
    ax.set_xlabel("time to last token (s, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="FCFS vs SageSched on an emulated backend.")
    p.add_argument("--requests", type=int, default=200, help="first N requests of the window")
    p.add_argument("--max-output", type=int, default=256, help="output length cap (tokens)")
    p.add_argument(
        "--utilisation", type=float, default=1.6, help="offered work over the engine's peak rate"
    )
    p.add_argument("--cap", type=int, help="fixed in-flight cap (default: self-tuning)")
    p.add_argument("--time-scale", type=float, default=1.0, help="emulator speed-up (0.5: 2x)")
    p.add_argument("--policies", default="fcfs,sagesched", help="first is the baseline")
    p.add_argument(
        "--holdout",
        action="store_true",
        help="warm the predictor only on sample prompts the replay does not send",
    )
    p.add_argument("--png", default="demo-ttlt.png", help="where to write the TTLT plot")
    p.add_argument(
        "--capture", type=Path, help="record each gateway's traffic to CAPTURE/<policy>/"
    )
    p.add_argument("--json", action="store_true", help="print the summaries as JSON")
    return p


def _learn_curve(ch: Children, work: Path, emu: str, reqs: Sequence[ReplayRequest]) -> bytes | None:
    """One replay of the window through a gateway with FCFS, so the self-tuning cap learns
    the backend's curve (as a gateway that ran before would have): the curve memory file's
    bytes, or None if nothing was learnt."""
    from loadgen.replay.cli import run

    memory, port = work / "cap-memory.json", free_port()
    cfg = gateway_config(work / "learn.yaml", port, emu, "fcfs", None, None,
                         cap_memory=memory)  # fmt: skip
    t0 = time.monotonic()
    gw = ch.start("gateway-learn", sagesched("serve", "--config", str(cfg)),
                  f"http://127.0.0.1:{port}/ready", 180, env=ONE_THREAD)  # fmt: skip
    run(f"http://127.0.0.1:{port}", "tiny-llama", list(reqs), desc="learning the cap")
    ch.stop(gw)
    print(f"demo: the self-tuning cap learnt the backend's curve in "
          f"{time.monotonic() - t0:.0f} s", flush=True)  # fmt: skip
    return memory.read_bytes() if memory.exists() else None


def main(argv: list[str], prog: str = "sagesched demo") -> int:
    from loadgen.replay.cli import run

    args = _parser(prog).parse_args(argv)
    t_start = time.monotonic()
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    reqs, factor = workload(args.requests, args.max_output, args.utilisation, args.cap)
    outs = [r.output_tokens for r in reqs]
    print(f"demo: {SOURCE} window 0, {len(reqs)} requests over {reqs[-1].arrival_s:.1f} s "
          f"(load factor {factor:.2f}, {args.utilisation:.0%} of the engine's "
          f"{'peak' if args.cap is None else f'{args.cap}-request'} token rate), "
          f"outputs {min(outs)}-{max(outs)} tokens (mean {sum(outs) / len(outs):.0f}); "
          f"emulated backend {PROFILE} at time scale {args.time_scale}", flush=True)  # fmt: skip
    results: dict[str, list[ReplayResult]] = {}
    with tempfile.TemporaryDirectory(prefix="sagesched-demo-") as tmp, Children(Path(tmp)) as ch:
        work = Path(tmp)
        emu_port = free_port()
        emu = f"http://127.0.0.1:{emu_port}"
        ch.start("emulator", sagesched("emulate", "--port", str(emu_port), "--profile", PROFILE,
                 "--time-scale", str(args.time_scale)), emu + "/health", 60)  # fmt: skip
        warm = work / "warm.jsonl"
        n_warm = write_warm_set(reqs, warm, args.holdout)
        which = "not in the replay" if args.holdout else "(the replayed ones included)"
        print(f"demo: predictor warmed on {n_warm} sample prompts {which}", flush=True)
        memory = _learn_curve(ch, work, emu, reqs) if args.cap is None else None
        for policy in policies:
            port = free_port()
            capture = args.capture / policy if args.capture else None
            start_from = None
            if memory is not None:  # every arm starts from the same learnt curve
                start_from = work / f"cap-memory-{policy}.json"
                start_from.write_bytes(memory)
            cfg = gateway_config(work / f"{policy}.yaml", port, emu, policy, args.cap, warm,
                                 adaptive=args.cap is None, capture=capture,
                                 cap_memory=start_from)  # fmt: skip
            t0 = time.monotonic()
            # one torch thread: the embedder must leave a core to the backend and the client
            gw = ch.start(f"gateway-{policy}", sagesched("serve", "--config", str(cfg)),
                          f"http://127.0.0.1:{port}/ready", 180, env=ONE_THREAD)  # fmt: skip
            print(f"demo: gateway {policy} up in {time.monotonic() - t0:.1f} s", flush=True)
            results[policy] = run(f"http://127.0.0.1:{port}", "tiny-llama", reqs, desc=policy)
            ch.stop(gw)
    summaries = {p: summarize_replay(rs) for p, rs in results.items()}
    title = (f"{SOURCE} window 0, {len(reqs)} requests, {PROFILE} emulator, "
             f"gateway cap {args.cap or 'self-tuning'}")  # fmt: skip
    plot(results, Path(args.png), title)
    if args.json:
        print(json.dumps(summaries, indent=1))
    else:
        print()
        print(comparison(summaries))
        for p, rs in results.items():
            if failures(rs):
                print(f"{p}: failures {failures(rs)}")
            for w in warnings_for(summaries[p]):
                print(f"{p}: {w}")
        print(f"\nTTLT distributions: {args.png}   (demo took {time.monotonic() - t_start:.0f} s)")
        if args.capture:
            print(f"traffic captured under {args.capture}/<policy>/ (sagesched traces --capture)")
    return 0 if all(s["failed"] == 0 for s in summaries.values()) else 1
