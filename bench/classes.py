"""Request classes under overload, in simulation: bands + SageSched against one queue.

A mixed trace on the SageSched study's compute regime (`h200-llama3-8b`, the `continuous`
engine behind the gateway cap of 64, drained until every request finishes):

- `app`, class interactive (band 0): Azure 2023 conversation requests with their real arrival
  pattern, offering `--interactive` engine-seconds per second (`engine_seconds`: prefill plus
  decode share in a full batch, from the profile's per-request cost at the cap);
- `etl`, class batch (band 2): another stretch of the same trace at `--batch`;
- `flood`, class batch too: a third stretch at `--flood`, the noisy tenant.

Together they offer `--interactive + --batch + --flood` (1.5 by default) times what the
engine serves, for `--seconds`. Predictions: the true length × exp(N(0, σ²)), seeded, with a
log-normal belief of σ around it (the study's oracle-σ arm; σ = `--sigma`). Contenders: FCFS
and SageSched in one queue, llm-d-style bands (strict bands, tenant fairness, FCFS inside:
`bands:inner=fcfs`) and bands + SageSched (`bands`). Reported per class: p99 TTFT, mean TTLT,
and the share of the class's output tokens whose request finished by the end of the arrivals
+ `--grace` seconds (work done during the overload, not in the drain after it). The targets
(issue 20): interactive p99 TTFT under `--ttft-slo`, etl completing >= 90% of its work, and
mean TTLT in each band within 5% of single-band SageSched on that band's traffic alone.

    python bench/classes.py [--seconds 180] [--seeds 2] [--experiments]

Two more arms keep the interactive band's speed (`policies.shares`): the batch band at an
engine share (`--engine-share`) and an interactive TPOT objective (`--tpot-slo`); their
targets, per seed with 95% intervals: interactive mean TTLT within 15% of its traffic alone,
p99 TTFT within the SLO, etl >= 90% of its work, and the output tokens finished by the cut-off
>= 95% of one SageSched queue's.

`--experiments` adds the runs that explain the gaps (see docs/benchmarks.md): where the
interactive band's time goes against its traffic alone (queue vs decode speed), SageSched's
gain over FCFS inside each band against its gain on the band alone, shares when the
interactive band alone exceeds the engine, preempting lower bands, and the frontier of
interactive speed against throughput over TPOT objectives and engine shares.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadgen.engine.profiles import make_profile
from loadgen.metrics import RequestRecord
from loadgen.schema import TraceRequest
from loadgen.sim.simulator import Contender, resolve, simulate
from loadgen.traces import load_requests

PROFILE = "h200-llama3-8b"
ENGINE = "continuous"
CAP = 64
DRAIN_S = 36_000.0
SOURCE = "azure-conv-2023"
TENANTS = (("app", 0, 0), ("etl", 2, 6_000), ("flood", 2, 10_000))
"""(tenant, band, first index in the trace): disjoint stretches of the conversation trace."""
CONTENDERS = {
    "FCFS": "fcfs",
    "SageSched": "sagesched",
    "bands+FCFS": "bands:inner=fcfs",
    "bands+SageSched": "bands",
}


@dataclasses.dataclass(frozen=True)
class Engine:
    """Where the trace runs: the cost of a request comes from this profile at this cap."""

    profile: str = PROFILE
    cap: int = CAP
    max_prompt: int | None = None
    max_output: int | None = None
    """Lengths capped (the live run's small CPU model)."""

    def seconds(self, r: TraceRequest) -> float:
        """Engine time `r` takes in a full batch (the profile's per-request cost at the cap:
        its prefill plus its share of every decode iteration it is in)."""
        cost = make_profile(self.profile).cost_profile(self.cap)
        return cost.prefill_s(r.prompt_tokens) + float(
            cost.request_decode_s(r.prompt_tokens, r.output_tokens)
        )

    def fit(self, r: TraceRequest) -> TraceRequest:
        return dataclasses.replace(
            r,
            prompt_tokens=min(r.prompt_tokens, self.max_prompt or r.prompt_tokens),
            output_tokens=min(r.output_tokens, self.max_output or r.output_tokens),
        )


def mixed_trace(
    loads: dict[str, float], seconds: float, sigma: float, seed: int, engine: Engine = Engine()
) -> list[TraceRequest]:
    """Each tenant's stretch of the trace, its real gaps scaled so that it offers its load
    over `seconds`, with noisy predictions. `loads`: tenant → engine seconds offered per
    second (`Engine.seconds`: 1 keeps a full batch busy)."""
    trace = load_requests(SOURCE)
    rng = np.random.default_rng([seed, 20])
    out: list[TraceRequest] = []
    for tenant, band, start in TENANTS:
        if loads.get(tenant, 0.0) <= 0:
            continue
        want = loads[tenant] * seconds  # engine seconds to offer
        offset = start + seed * 997  # another stretch per seed
        chunk: list[TraceRequest] = []
        work = 0.0
        while work < want:
            r = engine.fit(trace[(offset + len(chunk)) % len(trace)])
            chunk.append(r)
            work += engine.seconds(r)
        t0 = chunk[0].arrival_s
        span = max(chunk[-1].arrival_s - t0, 1e-9)
        noise = np.exp(rng.normal(0.0, sigma, size=len(chunk)))
        for r, e in zip(chunk, noise, strict=True):
            out.append(
                dataclasses.replace(
                    r,
                    arrival_s=(r.arrival_s - t0) / span * seconds,
                    tenant=tenant,
                    priority=band,
                    predicted_output_tokens=max(1, round(r.output_tokens * e)),
                )
            )
    out.sort(key=lambda r: r.arrival_s)
    return out


def contender(spec: str) -> Contender:
    c = resolve(spec, inflight_cap=CAP)
    return dataclasses.replace(c, engine=dataclasses.replace(c.engine, drain_s=DRAIN_S))


@dataclasses.dataclass(frozen=True)
class Figures:
    """One group of requests in one run."""

    ttft_p99_s: float
    ttft_mean_s: float
    tpot_mean_ms: float
    ttlt_mean_s: float
    work: float
    """Share of the group's output tokens whose request finished by the cut-off."""
    decoding: float
    """Mean number of the group's requests decoding at once over the run."""


def figures(records: Sequence[RequestRecord], end_s: float) -> Figures:
    done = [r for r in records if r.finish_s is not None and r.first_token_s is not None]
    first = np.array([r.first_token_s for r in done], dtype=float)
    finish = np.array([r.finish_s for r in done], dtype=float)
    arrival = np.array([r.arrival_s for r in done])
    tokens = np.array([max(r.tokens, 2) for r in done])
    work = sum(r.output_tokens for r in records)
    by_end = sum(r.output_tokens for r, f in zip(done, finish, strict=True) if f <= end_s)
    span = finish.max() - arrival.min()
    return Figures(
        float(np.percentile(first - arrival, 99)),
        float(np.mean(first - arrival)),
        float(1000 * np.mean((finish - first) / (tokens - 1))),
        float(np.mean(finish - arrival)),
        by_end / work,
        float(np.sum(finish - first) / span),
    )


GROUPS = ("interactive", "batch band", "etl", "flood")
Row = dict[str, Figures]


def run(reqs: Sequence[TraceRequest], spec: str, sigma: float, end_s: float) -> Row:
    """Figures per group (the bands, then each tenant) of one simulation."""
    res = simulate(reqs, contender(spec), PROFILE, belief_sigma=sigma)
    return groups(res.records, reqs, end_s)


def alone(reqs: Sequence[TraceRequest], band: str) -> list[TraceRequest]:
    return [r for r in reqs if (r.priority == 0) == (band == "interactive")]


def mean_rows(rows: Sequence[Row]) -> Row:
    out = {}
    for name in rows[0]:
        values = np.array([dataclasses.astuple(r[name]) for r in rows])
        out[name] = Figures(*(float(v) for v in values.mean(axis=0)))
    return out


def table(results: dict[str, Row], groups: Sequence[str] = GROUPS) -> None:
    print("| contender | " + " | ".join(
        f"{g} p99 TTFT s | {g} mean TTLT s | {g} work" for g in groups) + " |")  # fmt: skip
    print("|---|" + "---:|" * (3 * len(groups)))
    for label, row in results.items():
        cells = []
        for g in groups:
            f = row.get(g)
            cells += ["-"] * 3 if f is None else [
                f"{f.ttft_p99_s:.2f}", f"{f.ttlt_mean_s:.1f}", f"{100 * f.work:.0f}%"]  # fmt: skip
        print(f"| {label} | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=300.0)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--interactive", type=float, default=0.5)
    ap.add_argument("--batch", type=float, default=0.2)
    ap.add_argument("--flood", type=float, default=0.8)
    ap.add_argument("--sigma", type=float, default=0.5)
    ap.add_argument("--ttft-slo", type=float, default=2.0)
    ap.add_argument("--grace", type=float, default=50.0)
    ap.add_argument(
        "--engine-share",
        type=float,
        default=0.25,
        help="the batch band's engine share in the shares arm",
    )
    ap.add_argument(
        "--tpot-slo",
        type=float,
        default=0.010,
        help="the interactive class's TPOT objective (s) in the TPOT arm",
    )
    ap.add_argument("--experiments", action="store_true")
    ap.add_argument("--live", action="store_true", help="through the gateway on the emulator")
    ap.add_argument("--live-cap", type=int, default=8)
    args = ap.parse_args()
    if args.live:
        live(args)
        return
    loads = {"app": args.interactive, "etl": args.batch, "flood": args.flood}
    end = args.seconds + args.grace
    specs = dict(CONTENDERS)
    specs.update(speed_arms(args.engine_share, args.tpot_slo))
    if args.experiments:
        specs["bands+SageSched, preempt_lower_bands"] = "bands:preempt_lower_bands=true"
    runs: dict[str, list[Row]] = {}
    for seed in range(args.seeds):
        reqs = mixed_trace(loads, args.seconds, args.sigma, seed)
        for label, spec in specs.items():
            runs.setdefault(label, []).append(run(reqs, spec, args.sigma, end))
        for band in ("interactive", "batch band"):
            for label, spec in (("SageSched", "sagesched"), ("FCFS", "fcfs")):
                row = run(alone(reqs, band), spec, args.sigma, end)
                runs.setdefault(f"{label}, {band} alone", []).append({band: row[band]})
        print(f"seed {seed}: {len(reqs)} requests", file=sys.stderr, flush=True)
    results = {label: mean_rows(rows) for label, rows in runs.items()}
    total = sum(loads.values())
    print(f"load {total:g} (app {args.interactive:g}, etl {args.batch:g}, flood "
          f"{args.flood:g}) for {args.seconds:g} s, sigma {args.sigma:g}, mean of "
          f"{args.seeds} seeds; work: output tokens finished by the arrivals' end + "
          f"{args.grace:g} s\n")  # fmt: skip
    table(results)
    targets(results, args.ttft_slo)
    speed_targets(runs, args.ttft_slo)
    if args.experiments:
        experiments(results, args)


def speed_arms(share: float, tpot_s: float) -> dict[str, str]:
    """The arms that keep the interactive band's speed (`policies.shares`)."""
    return {
        f"bands+SageSched, batch engine share {share:g}": f"bands:engine_shares=2:{share:g}",
        f"bands+SageSched, interactive TPOT {1000 * tpot_s:g} ms": f"bands:tpot_slos=0:{tpot_s:g}",
    }


def ci95(values: Sequence[float]) -> str:
    """Mean ± the 95% half-width over seeds (t distribution)."""
    from scipy import stats

    v = np.asarray(values, dtype=float)
    if len(v) < 2:
        return f"{v.mean():.3f}"
    half = stats.t.ppf(0.975, len(v) - 1) * v.std(ddof=1) / np.sqrt(len(v))
    return f"{v.mean():.3f} ± {half:.3f}"


def speed_targets(runs: dict[str, list[Row]], slo: float) -> None:
    """Per seed, against the interactive traffic alone and one SageSched queue: interactive
    mean TTLT (target within +15%), p99 TTFT (within the SLO), etl's work (>= 90%), and the
    output tokens finished by the cut-off over all requests (>= 0.95 of one SageSched queue)."""
    alone = [r["interactive"].ttlt_mean_s for r in runs["SageSched, interactive alone"]]
    single = [r["all"].work for r in runs["SageSched"]]
    print("\nspeed targets, mean ± 95% CI over seeds\n")
    print("| arm | interactive TTLT / alone (≤ 1.15) | interactive p99 TTFT s (≤ "
          f"{slo:g}) | interactive TPOT ms | etl work (≥ 0.90) | tokens done / one queue "
          "(≥ 0.95) |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|")
    for label in runs:
        rows = runs[label]
        if "all" not in rows[0] or "alone" in label:
            continue
        ratio = [r["interactive"].ttlt_mean_s / a for r, a in zip(rows, alone, strict=True)]
        done = [r["all"].work / s for r, s in zip(rows, single, strict=True)]
        print(f"| {label} | {ci95(ratio)} | {ci95([r['interactive'].ttft_p99_s for r in rows])} "
              f"| {ci95([r['interactive'].tpot_mean_ms for r in rows])} "
              f"| {ci95([r['etl'].work for r in rows])} | {ci95(done)} |")  # fmt: skip


def targets(results: dict[str, Row], slo: float) -> None:
    bs = results["bands+SageSched"]
    print(f"\ntargets, bands+SageSched: interactive p99 TTFT {bs['interactive'].ttft_p99_s:.2f} s "
          f"(SLO {slo:g} s); etl work {100 * bs['etl'].work:.0f}% (>= 90%)")  # fmt: skip
    for band in ("interactive", "batch band"):
        mixed, solo = bs[band].ttlt_mean_s, results[f"SageSched, {band} alone"][band].ttlt_mean_s
        print(f"  {band} mean TTLT {mixed:.2f} s vs SageSched on its traffic alone "
              f"{solo:.2f} s: {100 * (mixed / solo - 1):+.0f}% (target within 5%)")  # fmt: skip


def experiments(results: dict[str, Row], args: argparse.Namespace) -> None:
    print("\nwhere the time goes (means over the band's requests)\n")
    print("| run | band | TTFT s | TPOT ms | TTLT s | decoding at once |")
    print("|---|---|---:|---:|---:|---:|")
    for band in ("interactive", "batch band"):
        for label in (f"SageSched, {band} alone", "bands+SageSched"):
            f = results[label][band]
            print(f"| {label} | {band} | {f.ttft_mean_s:.2f} | {f.tpot_mean_ms:.1f} | "
                  f"{f.ttlt_mean_s:.2f} | {f.decoding:.1f} |")  # fmt: skip
    print("\nSageSched's gain over FCFS in mean TTLT, inside each band\n")
    print("| band | on its traffic alone | inside the bands (mixed trace) |")
    print("|---|---:|---:|")
    for band in ("interactive", "batch band"):
        solo = 1 - (results[f"SageSched, {band} alone"][band].ttlt_mean_s
                    / results[f"FCFS, {band} alone"][band].ttlt_mean_s)  # fmt: skip
        mixed = 1 - (results["bands+SageSched"][band].ttlt_mean_s
                     / results["bands+FCFS"][band].ttlt_mean_s)  # fmt: skip
        print(f"| {band} | {100 * solo:.0f}% | {100 * mixed:.0f}% |")
    # shares: the interactive band alone exceeds the engine
    loads = {"app": 1.1, "etl": args.batch, "flood": 0.2}
    print(f"\nshares: app {loads['app']:g}, etl {loads['etl']:g}, flood {loads['flood']:g} "
          f"(the interactive band alone exceeds the engine), seed 0\n")  # fmt: skip
    reqs = mixed_trace(loads, args.seconds, args.sigma, 0)
    end = args.seconds + args.grace
    share = {label: run(reqs, spec, args.sigma, end) for label, spec in (
        ("bands+SageSched (strict)", "bands"),
        ("bands+SageSched, batch share 0.1", "bands:band_shares=2:0.1"),
        ("bands+SageSched, batch share 0.25", "bands:band_shares=2:0.25"))}  # fmt: skip
    table(share)
    frontier(args)


FRONTIER_TPOT_S = (0.0085, 0.009, 0.010, 0.011, 0.012, 0.014)
FRONTIER_SHARES = (0.05, 0.1, 0.15, 0.25, 0.5)


def frontier(args: argparse.Namespace) -> None:
    """Interactive speed against the fleet's throughput: the TPOT objective and the batch
    engine share swept on the main mixed trace, means over the seeds."""
    loads = {"app": args.interactive, "etl": args.batch, "flood": args.flood}
    end = args.seconds + args.grace
    arms = {"bands+SageSched (no bound)": "bands"}
    arms |= {f"TPOT objective {1000 * x:g} ms": f"bands:tpot_slos=0:{x:g}" for x in FRONTIER_TPOT_S}
    arms |= {f"batch engine share {x:g}": f"bands:engine_shares=2:{x:g}" for x in FRONTIER_SHARES}
    rows: dict[str, list[tuple[float, ...]]] = {label: [] for label in arms}
    for seed in range(args.seeds):
        reqs = mixed_trace(loads, args.seconds, args.sigma, seed)
        solo = run(alone(reqs, "interactive"), "sagesched", args.sigma, end)["interactive"]
        single = run(reqs, "sagesched", args.sigma, end)["all"]
        for label, spec in arms.items():
            row = run(reqs, spec, args.sigma, end)
            i = row["interactive"]
            rows[label].append((i.ttlt_mean_s / solo.ttlt_mean_s, row["all"].work / single.work,
                                row["etl"].work, i.tpot_mean_ms, solo.tpot_mean_ms,
                                i.ttft_p99_s))  # fmt: skip
    print(f"\nspeed against throughput: interactive mean TTLT / its traffic alone, tokens done "
          f"by the cut-off / one SageSched queue; means of {args.seeds} seeds\n")  # fmt: skip
    print("| arm | interactive TTLT / alone | tokens done / one queue | etl work | "
          "interactive TPOT ms (alone) | interactive p99 TTFT s |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|")
    for label, values in rows.items():
        r, done, etl, tpot, solo_tpot, p99 = np.mean(values, axis=0)
        print(f"| {label} | {r:.3f} | {done:.3f} | {100 * etl:.0f}% | {tpot:.1f} ({solo_tpot:.1f}) "
              f"| {p99:.2f} |", flush=True)  # fmt: skip


# -- the live run: the same direction through the real gateway on the emulator ---------------

LIVE: dict[str, tuple[str, bool, float | None]] = {
    "FCFS": ("fcfs", False, None),
    "SageSched": ("sagesched", False, None),
    "bands+FCFS": ("fcfs", True, None),
    "bands+SageSched": ("sagesched", True, None),
    "bands+SageSched, batch engine share 0.25": ("sagesched", True, 0.25),
}
"""label → (gateway policy, send the class and tenant headers, the batch class's
`engine_share`). Without the headers every request is one class and one tenant: the gateway's
bands reduce to the policy alone."""


def with_batch_share(cfg: Path, share: float) -> None:
    """The shipped classes in the gateway config `cfg`, the batch class with `share`."""
    import yaml

    from gateway.config import DEFAULT_CLASSES

    rows = [dataclasses.asdict(c) for c in DEFAULT_CLASSES]
    for row in rows:
        row["api_keys"] = list(row["api_keys"])
        if row["name"] == "batch":
            row["engine_share"] = share
    data = yaml.safe_load(cfg.read_text())
    data["classes"] = {"list": rows}
    cfg.write_text(yaml.safe_dump(data))


def live(args: argparse.Namespace) -> None:
    """Start `sagesched emulate` (cpu-tiny-vllm), then per contender a gateway (fixed cap,
    predictor warmed on the shipped prompt sample), replay the mixed trace with real prompts
    (streamed, class and tenant headers for the banded runs) and report per class."""
    import tempfile

    from loadgen.demo.run import ONE_THREAD, gateway_config, write_warm_set
    from loadgen.procs import Children, free_port, sagesched
    from loadgen.replay.prompts import build_requests

    engine = Engine("cpu-tiny-vllm", args.live_cap, max_prompt=512, max_output=128)
    loads = {"app": args.interactive, "etl": args.batch, "flood": args.flood}
    trace = mixed_trace(loads, args.seconds, args.sigma, 0, engine)
    prompts = build_requests(trace, prompts="sample", seed=0)
    print(f"live: {len(trace)} requests over {args.seconds:g} s, load {sum(loads.values()):g} "
          f"of cpu-tiny-vllm at cap {args.live_cap}", flush=True)  # fmt: skip
    results: dict[str, Row] = {}
    with tempfile.TemporaryDirectory(prefix="sagesched-classes-") as tmp, Children(Path(tmp)) as ch:
        work = Path(tmp)
        emu_port = free_port()
        emu = f"http://127.0.0.1:{emu_port}"
        ch.start("emulator", sagesched("emulate", "--port", str(emu_port), "--profile",
                 "cpu-tiny-vllm"), emu + "/health", 60)  # fmt: skip
        warm = work / "warm.jsonl"
        write_warm_set(prompts, warm, holdout=False)
        for label, (policy, classes, share) in LIVE.items():
            port = free_port()
            cfg = gateway_config(work / f"{port}.yaml", port, emu, policy, args.live_cap, warm,
                                 adaptive=False)  # fmt: skip
            if share is not None:
                with_batch_share(cfg, share)
            gw = ch.start(f"gateway-{port}", sagesched("serve", "--config", str(cfg)),
                          f"http://127.0.0.1:{port}/ready", 180, env=ONE_THREAD)  # fmt: skip
            records = asyncio.run(replay(f"http://127.0.0.1:{port}", trace, prompts, classes))
            ch.stop(gw)
            results[label] = groups(records, trace, args.seconds + args.grace)
            print(f"live: {label} done", flush=True)
    print(f"\nlive, emulator: load {sum(loads.values()):g} for {args.seconds:g} s, cap "
          f"{args.live_cap}; work by the arrivals' end + {args.grace:g} s\n")  # fmt: skip
    table(results)
    print("\nmeasured time per output token (ms, mean over the band's completed requests)\n")
    print("| contender | interactive TPOT ms | batch band TPOT ms |")
    print("|---|---:|---:|")
    for label, row in results.items():
        print(f"| {label} | {row['interactive'].tpot_mean_ms:.1f} | "
              f"{row['batch band'].tpot_mean_ms:.1f} |")  # fmt: skip


def groups(records: Sequence[RequestRecord], trace: Sequence[TraceRequest], end: float) -> Row:
    """Figures per group: the bands, each tenant, and all requests (`records[i]` is
    `trace[i]`'s)."""
    by: dict[str, list[RequestRecord]] = {}
    for rec, req in zip(records, trace, strict=True):
        by.setdefault("interactive" if req.priority == 0 else "batch band", []).append(rec)
        by.setdefault(req.tenant or "", []).append(rec)
        by.setdefault("all", []).append(rec)
    return {name: figures(recs, end) for name, recs in by.items()}


async def replay(
    url: str, trace: Sequence[TraceRequest], prompts: Sequence[Any], classes: bool
) -> list[RequestRecord]:
    """Send every request at its arrival (open loop, streamed); the client's own clock."""
    import aiohttp

    records = [RequestRecord(i, r.arrival_s, r.prompt_tokens, p.output_tokens)
               for i, (r, p) in enumerate(zip(trace, prompts, strict=True))]  # fmt: skip
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as s:
        t0 = time.monotonic()

        async def one(i: int) -> None:
            r, p, rec = trace[i], prompts[i], records[i]
            await asyncio.sleep(max(0.0, r.arrival_s - (time.monotonic() - t0)))
            headers = {"X-SageSched-Class": "interactive" if r.priority == 0 else "batch",
                       "X-SageSched-Tenant": r.tenant or ""} if classes else {}  # fmt: skip
            body = {"model": "tiny-llama", "prompt": p.prompt, "max_tokens": p.output_tokens,
                    "ignore_eos": True, "stream": True}  # fmt: skip
            async with s.post(url + "/v1/completions", json=body, headers=headers) as resp:
                if resp.status != 200:
                    rec.dropped = True
                    await resp.read()
                    return
                async for line in resp.content:
                    if line.startswith(b"data: {") and b'"text"' in line:
                        if rec.first_token_s is None:
                            rec.first_token_s = time.monotonic() - t0
                        rec.tokens += 1
            rec.finish_s = time.monotonic() - t0

        await asyncio.gather(*(one(i) for i in range(len(trace))))
    return records


if __name__ == "__main__":
    main()
