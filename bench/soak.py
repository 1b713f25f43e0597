"""The mixed soak (issue 18 part 3): a long, CPU-light, mixed load on a real `sagesched serve`
process in front of `sagesched emulate`, watching the gateway's memory and descriptors.

Load (open loop, Poisson arrivals at `--rate` per second, one client process): streamed and
non-streamed chat and completions over a pool of prompts (each prompt's natural answer length
is fixed by the emulator, so the predictor learns it and SageSched orders and preempts on it),
streamed chats the client abandons after a few tokens, bad requests (400), and every
`--burst-every` seconds a burst of twice the queue bound at once (429s). Policy `sagesched`
preempting by its index (`POLICY`), fixed backend cap.

Warm start: the gateway loads a predictor snapshot whose history (`HISTORY_ITEMS`) and
learners' rings are full, and the warm-up begins with every prompt sent once as a chat and
once as a completion (one token each): the bounded structures that fill per completion or per
distinct prompt are full before the first checkpoint, so growth after it is a leak, not a
ring filling up (docs/reliability.md, "The SageSched soak's RSS").

Measured: every `--sample-s` seconds the gateway's RSS and open descriptors (`/proc`), and
the CPU seconds of the gateway, the emulator and the client; a table per minute. Pass/fail is
judged at two idle checkpoints, after the warm-up and at the end, each reached by letting
every request finish and the gateway close the client's connections; its pooled keep-alive
connections to the backend are counted apart (not growth):

- RSS growth from the first to the second checkpoint < `--max-rss-growth` (5%);
- no more open descriptors (the pool apart) at the second checkpoint than at the first;
- none lost: `sagesched_requests_total` equals the requests sent, no 5xx, no non-JSON error,
  no traceback in the gateway's log.

Exit status 0 when all hold, 1 otherwise. `make soak` runs it (10 minutes of load).

Run: `python bench/soak.py [--minutes 10] [--warmup-minutes 2] [--rate 3]` (`make soak`).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from loadgen import stress
from loadgen.emulator.tokens import natural_output_tokens
from loadgen.procs import Children, free_port, sagesched
from loadgen.procstat import cpu_s, fd_count, rss_kb, socket_remote_ports

KEEPALIVE_S = 60
"""The gateway's upstream connector keeps idle connections this long (`gateway/serving/app.py`)."""
SETTLE_S = 10.0
SETTLE_MAX_S = 60.0
POLICY = "sagesched:preempt_rule=index"
"""SageSched preempting whenever its index says so: its default rule (`pays`) almost never
preempts at a cap of 8 with a queue (docs/policies.md), and the soak must exercise the
abort-and-continue path."""
MAX_WAITING = 32
RATE = 1.5
"""Arrivals per second: about two thirds of what the backend serves (8 slots of ~4 s answers
at time scale 2), so the queue drains between bursts. At 3 a second (150%) the queue stayed
full, and long answers, preempted again and again by the index rule, waited past the queue
timeout after they had started (a starved request ends as an SSE error, `upstream_broken`)."""
CAPACITY = 8
PROMPTS = 300
HISTORY_ITEMS = 4096
"""The predictor's history bound in the soak. The gateway starts from a snapshot in which
this history, and the learners' rings (4,000 items), are already full, as a production
gateway restarting from its snapshot is; the soak then measures growth past the bounds
(leaks), not the bounded rings filling, which at the default bound (100,000 items) goes on
for ~100,000 completions (~220 MB per served model; docs/reliability.md)."""
WARM_ITEMS = 5000
MODEL = "tiny-llama"
MIX = {  # kind: weight
    "chat-stream": 35,
    "chat": 20,
    "completion-stream": 15,
    "completion": 10,
    "cancel": 12,
    "bad": 8,
}
WORDS = (  # noqa: SIM905
    "schedule queue token latency batch stream model prompt answer cache memory server request "
    "length policy kernel engine decode prefill budget window replica tenant deadline priority"
).split()


@dataclass
class Tally:
    """What the client sent and saw, per minute and in all."""

    sent: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    kinds: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    minute: Counter[str] = field(default_factory=Counter)


def prompt_pool(seed: int) -> list[str]:
    rng = random.Random(seed)
    return [
        f"Question {i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 60)))
        for i in range(PROMPTS)
    ]


def warm_snapshot(path: Path, prompts: list[str], seed: int) -> None:
    """A predictor snapshot for `MODEL` with `WARM_ITEMS` completions of the soak's prompts
    (their emulated natural lengths) in a `HISTORY_ITEMS` history: its rings full."""
    rng = random.Random(seed)
    records = path.with_suffix(".jsonl")
    with records.open("w") as f:
        for _ in range(WARM_ITEMS):
            text = rng.choice(prompts)
            f.write(json.dumps({"prompt": text, "output_tokens": natural_output_tokens(text)}))
            f.write("\n")
    # A child process: run as a script, this file's folder (bench/, with its own
    # predictor.py) would shadow the `predictor` package here.
    subprocess.run(sagesched("predictor", "warm", "--from", str(records), "--out", str(path),
                             "--model", MODEL, "--set", f"capacity_items={HISTORY_ITEMS}"),
                   check=True, stdout=subprocess.DEVNULL)  # fmt: skip


async def prime(base: str, prompts: list[str], tally: Tally) -> None:
    """Every prompt once as a chat and once as a completion, one token each, before the
    warm-up's load: what the gateway keeps per distinct prompt (its embedding cache, the
    embedder's shapes) is then filled before the first checkpoint, however the load's random
    draws fall."""
    rng = random.Random(0)
    gate = asyncio.Semaphore(CAPACITY)
    s: aiohttp.ClientSession

    async def one_token(kind: str, text: str) -> None:
        async with gate:
            await one(s, base, kind, text, rng, tally, max_tokens=1)

    async with stress.session(timeout_s=300) as s:
        await asyncio.gather(
            *(one_token(kind, text) for text in prompts for kind in ("chat", "completion"))
        )


def make_request(
    kind: str, text: str, rng: random.Random, max_tokens: int = 512
) -> tuple[str, dict[str, Any], int | None]:
    """(path, body, cancel_after) of one request of `kind`."""
    if kind == "bad":
        bad: list[dict[str, Any]] = [
            {"model": MODEL, "messages": "not a list"},
            {"model": MODEL, "messages": [{"role": "user", "content": text}],
             "max_tokens": -3},
            {"model": MODEL, "prompt": text, "max_tokens": "many"},
        ]  # fmt: skip
        i = rng.randrange(len(bad))
        return ("/v1/completions" if i == 2 else "/v1/chat/completions"), bad[i], None
    stream = kind.endswith("stream") or kind == "cancel"
    usage = {"stream_options": {"include_usage": True}} if stream else {}
    if kind.startswith("completion"):
        body = {"model": MODEL, "prompt": text, "max_tokens": max_tokens, "stream": stream,
                **usage}  # fmt: skip
        return "/v1/completions", body, None
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "stream": stream,
        **usage,
    }
    return "/v1/chat/completions", body, (rng.randint(1, 6) if kind == "cancel" else None)


def streamed_short(res: stress.Result, stream: bool) -> bool:
    """A whole stream whose text pieces differ from its usage count: a piece was lost."""
    return stream and res.status == 200 and not res.cancelled and res.usage_tokens != res.tokens


async def one(
    s: aiohttp.ClientSession, base: str, kind: str, text: str, rng: random.Random, tally: Tally,
    max_tokens: int = 512,
) -> None:  # fmt: skip
    path, body, cancel_after = make_request(kind, text, rng, max_tokens)
    tally.sent += 1
    tally.kinds[kind] += 1
    tally.minute["sent"] += 1
    try:
        res = await stress.request(s, base + path, body, cancel_after=cancel_after)
    except (aiohttp.ClientError, TimeoutError) as exc:
        tally.problems.append(f"{kind}: {type(exc).__name__}: {exc}")
        return
    tally.statuses[res.status] += 1
    tally.minute[str(res.status) if res.status in (200, 400, 429) else "other"] += 1
    if res.cancelled:
        tally.minute["cancelled"] += 1
    expected = {400} if kind == "bad" else {200, 429}
    if res.status not in expected or not res.error_json:
        tally.problems.append(f"{kind}: status {res.status} (json error: {res.error_json})")
    elif res.status == 429 and res.retry_after is None:
        tally.problems.append(f"{kind}: 429 without Retry-After")
    elif res.stream_error is not None:
        tally.problems.append(f"{kind}: stream broke after {res.tokens} pieces: {res.stream_error}")
    elif streamed_short(res, bool(body.get("stream"))):
        tally.problems.append(f"{kind}: {res.tokens} pieces, usage {res.usage_tokens}")


async def load(base: str, seconds: float, rate: float, burst_every: float, seed: int,
               prompts: list[str], tally: Tally, on_minute: Any) -> None:  # fmt: skip
    """Open-loop arrivals for `seconds`, then wait for every request to end."""
    rng = random.Random(seed)
    kinds, weights = zip(*MIX.items(), strict=True)
    tasks: set[asyncio.Task[None]] = set()
    t0 = time.monotonic()
    next_burst = t0 + burst_every
    next_minute = t0 + 60
    async with stress.session(timeout_s=300) as s:
        now = t0
        while now - t0 < seconds:
            await asyncio.sleep(rng.expovariate(rate))
            now = time.monotonic()
            arrivals = [rng.choices(kinds, weights)[0]]
            if now >= next_burst:
                arrivals += ["chat"] * (2 * MAX_WAITING)
                next_burst += burst_every
            for kind in arrivals:
                task = asyncio.create_task(one(s, base, kind, rng.choice(prompts), rng, tally))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if now >= next_minute:
                on_minute()
                next_minute += 60
        if tasks:
            await asyncio.wait(tasks)
    on_minute()


def counted(base: str) -> float:
    return stress.total(stress.metrics(base), "sagesched_requests_total")


def wait_counted(base: str, want: int, timeout_s: float = 30.0) -> float:
    """The counter once it reaches `want` (cancellations are counted when the gateway notices
    the closed connection), or its value at the deadline."""
    deadline = time.monotonic() + timeout_s
    while (got := counted(base)) < want and time.monotonic() < deadline:
        time.sleep(0.5)
    return got


@dataclass
class Checkpoint:
    name: str
    rss_kb: int
    fds: int
    upstream: int
    """Of `fds`: idle keep-alive connections to the backend (the upstream pool)."""
    kinds: dict[str, int]
    """Open descriptors by kind (socket, pipe, anon_inode:..., or file)."""

    @property
    def own(self) -> int:
        """Descriptors the gateway holds apart from its pooled upstream connections."""
        return self.fds - self.upstream


def fd_kinds(pid: int) -> dict[str, int]:
    kinds: Counter[str] = Counter()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed meanwhile
            continue
        kinds[target.split("[")[0].rstrip(":") if "[" in target else "file"] += 1
    return dict(sorted(kinds.items()))


def checkpoint(name: str, pid: int, backend_port: int) -> Checkpoint:
    """Idle reading once the client's connections are closed on the gateway's side: the
    count of descriptors other than the upstream pool has not changed for `SETTLE_S` (at
    most `SETTLE_MAX_S`). The pool (kept `KEEPALIVE_S`, closed on aiohttp's cleanup tick, so
    up to twice that) is counted apart, from the sockets' peers, instead of waited out. RSS
    is the lowest read over that settled window: a periodic snapshot save landing in it
    holds ~18 MB for a second or two before giving it back, which is not growth (a leak
    raises every reading)."""

    def read() -> Checkpoint:
        upstream = socket_remote_ports(pid).count(backend_port)
        return Checkpoint(name, rss_kb(pid), fd_count(pid), upstream, fd_kinds(pid))

    deadline = time.monotonic() + SETTLE_MAX_S
    last, since = read(), time.monotonic()
    low = last.rss_kb
    while time.monotonic() < deadline and time.monotonic() - since < SETTLE_S:
        time.sleep(1.0)
        now = read()
        if now.own != last.own:
            since, low = time.monotonic(), now.rss_kb
        low = min(low, now.rss_kb)
        last = now
    return dataclasses.replace(last, rss_kb=low)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="load duration, warm-up included")
    ap.add_argument("--warmup-minutes", type=float, default=None,
                    help="default: 2, or a fifth of --minutes when shorter")  # fmt: skip
    ap.add_argument("--rate", type=float, default=RATE, help="mean arrivals per second")
    ap.add_argument("--burst-every", type=float, default=60.0, help="seconds between 429 bursts")
    ap.add_argument("--max-rss-growth", type=float, default=0.05)
    ap.add_argument("--policy", default=POLICY, help="the gateway's policy spec")
    ap.add_argument("--seed", type=int, default=18)
    ap.add_argument("--logs", type=Path, default=None, help="keep the servers' logs here")
    args = ap.parse_args()
    if args.warmup_minutes is None:
        args.warmup_minutes = min(2.0, args.minutes / 5)
    if not 0 < args.warmup_minutes < args.minutes:
        ap.error("--warmup-minutes must be in (0, --minutes)")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    logs = args.logs or Path(tempfile.mkdtemp(prefix="soak-"))
    prompts = prompt_pool(args.seed)
    tally = Tally()
    backend, port = free_port(), free_port()
    base = f"http://127.0.0.1:{port}"
    logs.mkdir(parents=True, exist_ok=True)
    snapshot = logs / "predictor.npz"
    warm_snapshot(snapshot, prompts, args.seed)
    with Children(logs) as kids:
        emu = kids.start("emulate", sagesched("emulate", "--profile", "cpu-tiny-vllm",
                                              "--port", str(backend), "--time-scale", "2",
                                              "--max-num-seqs", str(CAPACITY)),
                         f"http://127.0.0.1:{backend}/health")  # fmt: skip
        gw = kids.start("serve", sagesched("serve", "--backend", f"http://127.0.0.1:{backend}",
                                           "--port", str(port), "--policy", args.policy,
                                           "--preemption", "--no-adaptive-cap",
                                           "--max-inflight", str(CAPACITY),
                                           "--max-waiting", str(MAX_WAITING),
                                           "--queue-timeout", "300",
                                           "--predictor-snapshot", str(snapshot)),
                        f"{base}/ready")  # fmt: skip
        pids = {"gateway": gw.pid, "emulator": emu.pid}
        rows: list[dict[str, Any]] = []
        peak = {"rss": 0, "fds": 0}
        load_cpu: Counter[str] = Counter()
        load_wall = 0.0

        def cpu_now() -> dict[str, float]:
            return {k: cpu_s(p) for k, p in pids.items()} | {"client": time.process_time()}

        def on_minute(phase: str, last: dict[str, float]) -> None:
            now, cpu = time.monotonic(), cpu_now()
            wall = now - last["t"]
            m = tally.minute
            rows.append({
                "phase": phase, "minute": sum(r["phase"] == phase for r in rows) + 1,
                "sent": m["sent"], "200": m["200"], "400": m["400"], "429": m["429"],
                "cancelled": m["cancelled"], "other": m["other"],
                "rss_mib": peak["rss"] / 1024, "fds": peak["fds"],
                "emu_rss_mib": rss_kb(emu.pid) / 1024,
                **{f"cpu_{k}": 100 * (cpu[k] - last[k]) / wall for k in cpu},
            })  # fmt: skip
            last.update(cpu, t=now)
            m.clear()
            peak.update(rss=0, fds=0)

        async def sampler(stop: asyncio.Event) -> None:
            while not stop.is_set():
                peak["rss"] = max(peak["rss"], rss_kb(gw.pid))
                peak["fds"] = max(peak["fds"], fd_count(gw.pid))
                await asyncio.sleep(SAMPLE_S)

        async def phase(name: str, seconds: float, seed: int, primed: bool = False) -> None:
            nonlocal load_wall
            stop = asyncio.Event()
            sampling = asyncio.create_task(sampler(stop))
            start = {"t": time.monotonic(), **cpu_now()}
            last = dict(start)
            if primed:
                await prime(base, prompts, tally)
            await load(base, seconds, args.rate, args.burst_every, seed, prompts, tally,
                       lambda: on_minute(name, last))  # fmt: skip
            stop.set()
            await sampling
            load_wall += last["t"] - start["t"]
            load_cpu.update({k: last[k] - start[k] for k in pids.keys() | {"client"}})

        asyncio.run(phase("warm-up", args.warmup_minutes * 60, args.seed, primed=True))
        first = checkpoint("after warm-up", gw.pid, backend)
        asyncio.run(phase("soak", (args.minutes - args.warmup_minutes) * 60, args.seed + 1))
        got = wait_counted(base, tally.sent)
        second = checkpoint("end", gw.pid, backend)
        samples = stress.metrics(base)
        outcomes = stress.outcomes(base)
        log = (logs / "serve.log").read_text(errors="replace")
    report(rows)
    growth = (second.rss_kb - first.rss_kb) / first.rss_kb
    print("\ncheckpoints (idle; fds = the gateway's own + pooled upstream connections):")
    for c in (first, second):
        print(f"  {c.name:14s} RSS {c.rss_kb / 1024:7.1f} MiB  fds {c.own} + {c.upstream} "
              f"{c.kinds}")  # fmt: skip
    print(f"  RSS growth {growth:+.2%} (limit {args.max_rss_growth:.0%}), "
          f"own fds {second.own - first.own:+d} (limit +0)")  # fmt: skip
    print(f"requests: {tally.sent} sent, {got:.0f} counted by the gateway; statuses "
          f"{dict(sorted(tally.statuses.items()))}; outcomes {outcomes}; preemptions "
          f"{stress.total(samples, 'sagesched_preemptions_total'):.0f}")  # fmt: skip
    shares = (f"{k} {100 * v / load_wall:.1f}% of a core ({v:.0f} s)" for k, v in load_cpu.items())
    print(f"CPU during the {load_wall:.0f} s of load: " + ", ".join(shares))
    failures = list(tally.problems[:20])
    if growth >= args.max_rss_growth:
        failures.append(f"RSS grew {growth:.2%} after the warm-up")
    if second.own > first.own:
        failures.append(f"open descriptors grew {first.own} -> {second.own}")
    if got != tally.sent:
        failures.append(f"counted {got:.0f} != sent {tally.sent}: requests lost or counted twice")
    if "Traceback" in log or "internal error" in log:
        failures.append(f"a traceback in the gateway's log ({logs / 'serve.log'})")
    for f in failures:
        print("FAIL:", f)
    print("soak:", "FAIL" if failures else "PASS", f"(logs: {logs})")
    return 1 if failures else 0


SAMPLE_S = 5.0


def report(rows: list[dict[str, Any]]) -> None:
    cols = ["phase", "minute", "sent", "200", "400", "429", "cancelled", "other", "rss_mib", "fds",
            "emu_rss_mib", "cpu_gateway", "cpu_emulator", "cpu_client"]  # fmt: skip
    heads = ["phase", "min", "sent", "200", "400", "429", "cancel", "other", "gw RSS MiB (max)",
             "gw fds (max)", "emu RSS MiB", "gw CPU %", "emu CPU %", "client CPU %"]  # fmt: skip
    print("| " + " | ".join(heads) + " |")
    print("|" + "---|" * len(heads))
    for r in rows:
        cells = [f"{r[c]:.1f}" if isinstance(r[c], float) else str(r[c]) for c in cols]
        print("| " + " | ".join(cells) + " |")
    if rows:
        print(f"median gateway CPU {statistics.median(r['cpu_gateway'] for r in rows):.1f}%")


if __name__ == "__main__":
    sys.exit(main())
