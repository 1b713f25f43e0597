"""Measure the vLLM CPU build serving the tiny model and fit the `cpu-tiny-vllm` profile.

Run: `python -m loadgen.engine.fit_cpu [--url URL] [--out FILE]`. Without `--url` it starts
a real server (`loadgen.vllm_real`, installing it if needed). It prints the
coefficients that `loadgen.engine.profiles.CPU_TINY_VLLM` holds (with `--url URL
--window-correction`, also coefficients corrected on a replayed window; not used for the
committed numbers, since on a shared CPU they follow the load of the moment) and writes the
measurements (JSON rows) to `--out` (default `loadgen/engine/cpu_tiny_vllm_measurements.json`).
`--url URL --speed` only prints the time scale at which the committed profile matches that
server now (`speed_factor`; `sagesched emulate --time-scale`).

What is measured, from a client's point of view (so HTTP, tokenisation and scheduler overhead
are part of the numbers, as they are for the emulator's users), with prompts given as random
token ids (exact lengths; no prefix-cache hits):
- decode: B concurrent streams with P-token prompts and 64 output tokens (`ignore_eos`);
  (median TTLT − the prefill time of B·P tokens) / 63 is one iteration with B decodes at
  context ΣL ≈ B·(P + 32);
- prefill: one request with a P-token prompt and `max_tokens=1`: its TTFT is one iteration
  with P prefill tokens and no decodes (median of 5);
- loaded: the TTFT of a 128-token probe while B streams decode; what the linear model leaves
  unexplained, per streaming request, is the API server's extra overhead f.

Model (ms): a + b·B + c·ΣL + [P > 0]·(e + d·P), least squares weighted by 1/measured. The
profile reads a + b·B + c·ΣL + d·P as the iteration time and e as a per-request overhead (the
API server's work before the engine sees a request: it delays a request's first token but
runs beside other requests' iterations, so it is not charged to them).

Window fit (`fit_window`, what the fidelity test uses): a window of traffic replayed on the
server and on the emulator at time scale 1; the ratio of median TPOTs is the speed, and the
request overhead is shifted to meet the median TTFT. The coefficients carry the engine's
shape; speed and overhead are what differ between machines of one kind and, on a shared CPU,
from one minute to the next.

Speed probe (`speed_factor`, `--speed`): a few rounds of 1, 2 and 4 concurrent streams of
128-token prompts sent to the server and to the emulator; the geometric mean of the TTLT
ratios. Cheaper, but its fixed prompts miss what a window's varied prompts cost (on one
machine it read 1.7-2.3 while the window ran 3x slower than the profile; docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import random
import statistics
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from loadgen.engine.profiles import (
    CPU_TINY_VLLM,
    CpuTinyCoefficients,
    CpuTinyVllm,
    LatencyProfile,
    Scaled,
    make_profile,
)
from loadgen.regions import compress
from loadgen.schema import TraceRequest

DEFAULT_OUT = Path(__file__).with_name("cpu_tiny_vllm_measurements.json")
DECODE_CASES = ((16, (1, 2, 4, 8, 16, 32, 64, 96)), (768, (1, 4, 16, 32)))
"""(prompt tokens, batch sizes) of the decode measurements."""
DECODE_TOKENS = 64
PREFILL_PROMPTS = (8, 128, 256, 512, 1024, 1536, 2000)
PREFILL_REPS = 5
LOADED_BATCHES = (8, 32)
"""Streams decoding while the loaded-TTFT probes run."""
LOADED_TOKENS = 400
LOADED_PROMPT = 128


def random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 30000) for _ in range(n)]


async def stream_times(client: Any, model: str, prompt: list[int], tokens: int) -> list[float]:
    """Arrival times (perf_counter) of each content chunk of one streamed completion."""
    stamps: list[float] = []
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=tokens, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    async for ch in stream:
        if ch.choices and ch.choices[0].text is not None:
            stamps.append(time.perf_counter())
    return stamps


def prefill_model_ms(tokens: int) -> float:
    """What the committed profile predicts for a lone request's TTFT with `tokens` prompt
    tokens (request overhead + one iteration), in ms."""
    prof = make_profile("cpu-tiny-vllm")
    return (prof.request_overhead_s(0) + prof.iteration_s(0, 0, tokens)) * 1000


def _prefill_ms(rows: list[dict[str, Any]], tokens: int) -> float:
    """Time to prefill `tokens` prompt tokens, interpolated from this pass's prefill rows, in
    chunks of the server's 2,048-token budget."""
    pre = sorted((r["P"], r["ms"]) for r in rows if r["kind"] == "prefill")
    xs, ys = [p for p, _ in pre], [ms for _, ms in pre]
    full, rest = divmod(tokens, 2048)
    return full * float(np.interp(2048, xs, ys)) + (float(np.interp(rest, xs, ys)) if rest else 0)


async def streams_ttlt(
    c: Any, model: str, rng: random.Random, b: int, p: int, tokens: int
) -> float:
    """Median TTLT (s) over B streams sent at once (P-token random prompts, `tokens` each).

    Only the last chunk's time is used: on a busy CPU the API server delivers chunks in
    bursts (the first chunk can arrive with the twentieth), so gaps mislead."""
    t0 = time.perf_counter()
    runs = await asyncio.gather(
        *(stream_times(c, model, random_prompt(rng, p), tokens) for _ in range(b))
    )
    return statistics.median(r[-1] - t0 for r in runs)


async def decode_row(
    c: Any, model: str, rng: random.Random, p: int, b: int, rows: list[dict[str, Any]]
) -> dict[str, Any]:
    """One decode row: B streams sent at once; (median TTLT − prefill of the B prompts) /
    (T − 1)."""
    ttlt_ms = await streams_ttlt(c, model, rng, b, p, DECODE_TOKENS) * 1000
    ms = (ttlt_ms - _prefill_ms(rows, b * p)) / (DECODE_TOKENS - 1)
    return {"kind": "decode", "B": b, "ctx": b * (p + DECODE_TOKENS / 2), "P": 0,
            "ms": max(ms, 0.1)}  # fmt: skip


async def measure(url: str, model: str, seed: int = 0) -> list[dict[str, Any]]:
    """All measurement rows of one pass (see the module docstring)."""
    import openai

    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=3) as c:
        await stream_times(c, model, random_prompt(rng, 32), 8)  # warm-up
        for p in PREFILL_PROMPTS:
            ttft = []
            for _ in range(PREFILL_REPS):
                t0 = time.perf_counter()
                stamps = await stream_times(c, model, random_prompt(rng, p), 1)
                ttft.append((stamps[0] - t0) * 1000)
            rows.append({"kind": "prefill", "B": 0, "ctx": 0, "P": p,
                         "ms": statistics.median(ttft)})  # fmt: skip
        for p, batches in DECODE_CASES:
            for b in batches:
                rows.append(await decode_row(c, model, rng, p, b, rows))
        for b in LOADED_BATCHES:
            rows.append(await loaded_row(c, model, rng, b))
    return rows


async def loaded_row(
    c: Any, model: str, rng: random.Random, b: int, tokens: int = LOADED_TOKENS
) -> dict[str, Any]:
    """TTFT of a 128-token probe (median of 3) while B streams of 16-token prompts decode
    `tokens` tokens each."""
    background = [
        asyncio.create_task(stream_times(c, model, random_prompt(rng, 16), tokens))
        for _ in range(b)
    ]
    await asyncio.sleep(1.0)  # all admitted and decoding
    ttft = []
    for _ in range(3):
        t0 = time.perf_counter()
        stamps = await stream_times(c, model, random_prompt(rng, LOADED_PROMPT), 1)
        ttft.append((stamps[0] - t0) * 1000)
    await asyncio.gather(*background)
    return {"kind": "loaded", "B": b, "ctx": b * (16 + tokens / 4), "P": LOADED_PROMPT,
            "ms": statistics.median(ttft)}  # fmt: skip


def _repeat(url: str, model: str, runs: int) -> list[dict[str, Any]]:
    """`runs` measurement passes; each row's time is the median over the passes (a shared,
    busy CPU makes single passes noisy)."""
    passes = [asyncio.run(measure(url, model, seed=i)) for i in range(runs)]
    out = []
    for rows in zip(*passes, strict=True):
        out.append({**rows[0], "ms": statistics.median(r["ms"] for r in rows),
                    "ms_runs": [round(r["ms"], 2) for r in rows]})  # fmt: skip
    return out


def fit(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Coefficients (ms) of the linear model, the overhead per streaming request, and the
    linear model's max relative error."""
    lin = [r for r in rows if r["kind"] in ("prefill", "decode")]
    x = np.array([[1.0, r["B"], r["ctx"], float(r["P"] > 0), r["P"]] for r in lin], dtype=float)
    y = np.array([r["ms"] for r in lin])
    w = 1.0 / y
    coef, *_ = np.linalg.lstsq(x * w[:, None], y * w, rcond=None)
    coef = np.maximum(coef, 0.0)  # negative terms are noise; time never falls with more work
    err = float(np.max(np.abs(x @ coef - y) / y))
    a, b, c, e, d = (float(v) for v in coef)
    # loaded probes: TTFT = e + f·B + half an iteration of waiting + one mixed iteration
    extra = []
    for r in rows:
        if r["kind"] == "loaded":
            it = a + b * r["B"] + c * r["ctx"]
            extra.append((r["ms"] - e - 0.5 * it - (it + d * r["P"])) / r["B"])
    f = max(0.0, float(np.median(extra))) if extra else 0.0
    names = ("a_ms", "per_seq_ms", "per_ctx_ms", "request_overhead_ms", "per_prefill_tok_ms")
    out = {n: float(f"{v:.6g}") for n, v in zip(names, (a, b, c, e, d), strict=True)}
    out["overhead_per_running_ms"] = float(f"{f:.6g}")
    out["max_rel_err"] = round(err, 3)
    return out


CAL_WINDOW: dict[str, Any] = {"n": 30, "rate_per_s": 2.5, "seed": 1}
"""The calibration window (`synthetic_window` arguments): the fidelity test fits on it and
checks on another window (seed 4), so the check never sees the requests it was fitted on."""
WINDOW_PASSES = 3
"""vLLM replays of the calibration window for `--window-correction`; medians over them."""


def window_stats(records: list[Any]) -> dict[str, float]:
    """Median TTFT, TPOT (first to last token over the tokens after the first) and TTLT of a
    replay's successful requests, in ms."""
    ok = [r for r in records if r.ok and r.first_token_s is not None]
    tpot = [(r.ttlt_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "ttft_ms": statistics.median(r.ttft_s for r in ok) * 1000,
        "tpot_ms": statistics.median(tpot) * 1000,
        "ttlt_ms": statistics.median(r.ttlt_s for r in ok) * 1000,
    }


@dataclass(frozen=True, slots=True)
class WindowFit:
    """What differs between two machines of one kind, fitted on a replayed window: the speed
    of an iteration (`time_scale`, every iteration term times it) and the API server's fixed
    work per request (`request_overhead_ms`, at time scale 1). The committed coefficients keep
    the profile's shape: how an iteration grows with batch, context and prefill."""

    time_scale: float
    request_overhead_ms: float

    def profile(self, k: CpuTinyCoefficients | None = None) -> LatencyProfile:
        """`cpu-tiny-vllm` (or coefficients `k`) with this overhead, at this speed."""
        base = replace(k or CPU_TINY_VLLM, request_overhead_ms=self.request_overhead_ms)
        return Scaled(CpuTinyVllm(base), self.time_scale)


def fit_window(
    real: dict[str, float], emulated: dict[str, float], k: CpuTinyCoefficients | None = None
) -> WindowFit:
    """Fit `WindowFit` from `window_stats` of one window replayed on the server (`real`) and on
    the emulator running coefficients `k` (default: committed) at time scale 1 (`emulated`).

    The median TPOT is iteration time, so their ratio is the speed s. At speed s the emulated
    TTFT is about s·(overhead + the rest); the overhead is shifted so that it meets the
    measured TTFT: e' = e + TTFT_real / s − TTFT_emulated (never below zero)."""
    e = (k or CPU_TINY_VLLM).request_overhead_ms
    s = real["tpot_ms"] / emulated["tpot_ms"]
    return WindowFit(s, max(0.0, e + real["ttft_ms"] / s - emulated["ttft_ms"]))


@contextlib.asynccontextmanager
async def emulated(profile: LatencyProfile) -> AsyncIterator[str]:
    """The URL of an in-process emulator running `profile` at time scale 1, for the block.
    (Imports the emulator: this is a script, not part of the engine model.)"""
    from loadgen.emulator.server import EmulatorConfig, create_app, make_runner

    runner, port = await make_runner(create_app(EmulatorConfig(), profile), "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def emulate_window(profile: LatencyProfile, window: list[Any]) -> dict[str, float]:
    """`window_stats` of `window` replayed on an in-process emulator running `profile`."""
    from loadgen.replay import replay_window as replay

    async with emulated(profile) as url:
        return window_stats(await replay(url, "tiny-llama", window))


async def window_correction(url: str, model: str, coefs: dict[str, float]) -> dict[str, float]:
    """Coefficients `coefs` corrected on concurrent traffic (`--window-correction`): replay
    `CAL_WINDOW` on the server (`WINDOW_PASSES` times, medians) and on the emulator, then
    `fit_window`; the iteration terms are multiplied by the fitted speed."""
    from loadgen.replay import replay_window as replay
    from loadgen.replay import synthetic_window

    window = synthetic_window(**CAL_WINDOW)
    await replay(url, model, synthetic_window(n=16, rate_per_s=4.0, seed=99))  # warm-up
    # fresh prompts on every pass (prompt seeds 1, 2, ...): vLLM caches prefixes, and a
    # repeated prompt skips its prefill, which the emulator does not model
    seeds = range(1, WINDOW_PASSES + 1)
    passes = [window_stats(await replay(url, model, window, seed=i)) for i in seeds]
    real = {n: statistics.median(p[n] for p in passes) for n in passes[0]}
    names = ("a_ms", "per_seq_ms", "per_ctx_ms", "per_prefill_tok_ms", "request_overhead_ms",
             "overhead_per_running_ms")  # fmt: skip
    k = CpuTinyCoefficients(**{n: coefs[n] for n in names})
    emu = await emulate_window(CpuTinyVllm(k), window)
    fitted = fit_window(real, emu, k)
    s = fitted.time_scale
    k = replace(k, a_ms=k.a_ms * s, per_seq_ms=k.per_seq_ms * s, per_ctx_ms=k.per_ctx_ms * s,
                per_prefill_tok_ms=k.per_prefill_tok_ms * s,
                request_overhead_ms=fitted.request_overhead_ms * s)  # fmt: skip
    out = {n: float(f"{getattr(k, n):.6g}") for n in names}
    out |= {"tpot_scale": round(s, 3)}
    out |= {f"real_{n}": round(v, 2) for n, v in real.items()}
    out |= {f"emu_before_{n}": round(v, 2) for n, v in emu.items()}
    return out


SPEED_ROUNDS = ((1, 128, 48), (2, 128, 48), (4, 128, 48))
"""(streams sent at once, prompt tokens, output tokens) of the speed probe's rounds: the few
concurrent streams of a window at a few requests per second."""
SPEED_REPS = 3


async def probe_ttlt(url: str, model: str, seed: int = 0) -> list[float]:
    """The speed probe: per round of `SPEED_ROUNDS`, the median TTLT (s) over `SPEED_REPS`
    repetitions of B streams sent at once (random token-id prompts, `ignore_eos`). About
    3-4 s on the shared 2-core machine."""
    import openai

    rng = random.Random(seed)
    out = []
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=3) as c:
        for b, p, tokens in SPEED_ROUNDS:
            reps = [await streams_ttlt(c, model, rng, b, p, tokens) for _ in range(SPEED_REPS)]
            out.append(statistics.median(reps))
    return out


async def profile_probe(profile: str = "cpu-tiny-vllm") -> list[float]:
    """The speed probe against an in-process emulator running `profile` at time scale 1."""
    async with emulated(make_profile(profile)) as url:
        return await probe_ttlt(url, "tiny-llama")


async def speed_factor(url: str, model: str, reference: list[float], seed: int = 0) -> float:
    """How slow the server at `url` is now against the profile whose probe is `reference`
    (`profile_probe`): the emulator's `time_scale` that matches it. A CPU's speed is a
    property of the machine and the moment (on the shared 2-core machine it drifted between
    0.61 and 0.95 of the committed profile within minutes), the profile's coefficients are
    its shape: how an iteration's time grows with batch, context and prefill. The geometric
    mean over the probe's rounds of measured / reference TTLT."""
    pairs = zip(await probe_ttlt(url, model, seed=seed), reference, strict=True)
    return math.exp(statistics.fmean(math.log(m / r) for m, r in pairs))


BALANCE_PROBES = ((1, 1000, 1), (1, 16, 64), (8, 16, 64))
"""The balance probe's requests, (streams sent at once, prompt tokens, output tokens): a lone
long prefill (mostly per-prefill-token work), a lone decoding stream (mostly fixed work) and
eight decoding together (mostly per-sequence work)."""
BALANCE_FLOOR = 3.0
"""Prefill this much slower than the fixed work against the reference (or more): another
machine kind, whose profile shape is fitted again. The probe read 1.2-1.7 on the reference
kind and 7-12 on a CPU without AVX-512."""
SHRINK_FLOOR = 1.5
"""`MachineShape.shrink` below this is left at 1 (prompts as written)."""


@dataclass(frozen=True, slots=True)
class MachineBalance:
    """How a server's machine differs from the one `cpu-tiny-vllm` was fitted on, read by a
    cheap probe (`machine_balance`) in three numbers, each measured over predicted: the speed
    of the fixed work (the framework's per iteration and the API server's per request: a, e,
    f), of the work per decoding sequence (b, c) and of the work per prefilled token (d). On
    one machine kind they move together (a CPU that is busier or slower at everything);
    across kinds they need not: on the vLLM CPU build without AVX-512 the tiny model's bf16
    GEMMs ran prefill about 7x and each decoding sequence about 3-4x slower while the fixed
    work did not slow down. A single time scale cannot follow that; `shifted` says when the
    profile's shape must be fitted again (`machine_shape`)."""

    fixed_scale: float
    sequence_scale: float
    prefill_scale: float

    @property
    def prefill_ratio(self) -> float:
        return self.prefill_scale / self.fixed_scale

    @property
    def shifted(self) -> bool:
        """Is prefill far enough from the reference balance that the shape must be refitted?"""
        return self.prefill_ratio >= BALANCE_FLOOR


SHAPE_BATCH = 8
"""Decoding sequences at which `MachineShape` compares a machine's iterations with the
reference's (the few concurrent streams of the real-engine tests' windows)."""


@dataclass(frozen=True, slots=True)
class MachineShape:
    """The engine on this machine as the real-engine tests use it: coefficients `k` (the
    committed profile on the reference machine kind, a fit of `measure` on another kind), and
    how a window written for the reference machine is replayed here so that it is the same
    workload at this machine's speed: arrivals `stretch` times further apart (a decode
    iteration of `SHAPE_BATCH` sequences is that much slower) and prompts `shrink` times
    shorter (prefill is that much slower still). Both 1 on the reference kind."""

    k: CpuTinyCoefficients = CPU_TINY_VLLM
    stretch: float = 1.0
    shrink: float = 1.0

    @classmethod
    def fitted(cls, k: CpuTinyCoefficients) -> MachineShape:
        """The shape of a machine whose coefficients `k` were fitted on it."""
        ctx = SHAPE_BATCH * 264  # the windows' median prompt and half their median output
        ref, here = (CpuTinyVllm(c).iteration_s(SHAPE_BATCH, ctx, 0) for c in (CPU_TINY_VLLM, k))
        stretch = max(1.0, here / ref)
        shrink = k.per_prefill_tok_ms / CPU_TINY_VLLM.per_prefill_tok_ms / stretch
        return cls(k, stretch, shrink if shrink >= SHRINK_FLOOR else 1.0)

    def window(self, trace: list[TraceRequest]) -> list[TraceRequest]:
        """`trace` replayed on this machine: arrival times times `stretch`, prompts divided by
        `shrink` (at least 8 tokens); unchanged on the reference kind."""
        if self.stretch == 1.0 and self.shrink == 1.0:
            return list(trace)
        shrink = self.shrink
        shorter = [replace(r, prompt_tokens=max(8, round(r.prompt_tokens / shrink))) for r in trace]
        return compress(shorter, 1.0 / self.stretch)


async def machine_shape(url: str, model: str) -> tuple[MachineBalance, MachineShape]:
    """The balance probe, and the engine's shape on this machine: the committed profile
    when the balance is the reference's, else coefficients fitted on one pass of `measure`
    (about 2 minutes there)."""
    balance = await machine_balance(url, model)
    if not balance.shifted:
        return balance, MachineShape()
    # fresh prompts (the server may have been sent a pass of `measure` before, and caches)
    coefs = fit(await measure(url, model, seed=random.randrange(2**31)))
    names = [f.name for f in dataclasses.fields(CpuTinyCoefficients)]
    return balance, MachineShape.fitted(CpuTinyCoefficients(**{n: coefs[n] for n in names}))


def _probe_parts(streams: int, prompt: int, tokens: int) -> list[float]:
    """What the committed profile predicts for a probe's median TTLT (s), split into its
    fixed, per-sequence and per-prefill-token parts (streams sent at once: the median one
    waits for half the others' request overhead; all prefill in one iteration)."""
    k = CPU_TINY_VLLM
    zero = {n: 0.0 for n in ("a_ms", "request_overhead_ms", "overhead_per_running_ms",
                             "per_seq_ms", "per_ctx_ms", "per_prefill_tok_ms")}  # fmt: skip
    parts = (("a_ms", "request_overhead_ms", "overhead_per_running_ms"),
             ("per_seq_ms", "per_ctx_ms"), ("per_prefill_tok_ms",))  # fmt: skip
    out = []
    for names in parts:
        prof = CpuTinyVllm(replace(k, **(zero | {n: getattr(k, n) for n in names})))
        ctx = streams * (prompt + tokens // 2)
        t = prof.request_overhead_s(streams // 2) + prof.iteration_s(0, 0, streams * prompt)
        out.append(t + (prof.decode_run_s(streams, ctx, tokens - 1) if tokens > 1 else 0.0))
    return out


def balance_from(measured_s: list[float]) -> MachineBalance:
    """`MachineBalance` from the measured median TTLTs of `BALANCE_PROBES`: the three scales
    that make the committed profile's prediction for each probe (its fixed, per-sequence and
    per-prefill-token parts, `_probe_parts`) meet the measurement (a 3x3 linear system). A
    solution that is not positive (noise on a machine in the reference's balance) falls back
    to one scale for all: the lone decoding stream's."""
    m = np.array([_probe_parts(*probe) for probe in BALANCE_PROBES])
    scales = np.linalg.solve(m, np.array(measured_s))
    if (scales <= 0).any():
        scales = np.full(3, measured_s[1] / sum(m[1]))
    return MachineBalance(*(float(x) for x in scales))


async def _raw_ttlt(s: Any, url: str, model: str, prompt: list[int], tokens: int) -> float:
    """Seconds from sending one streamed completion to its last chunk, over plain HTTP (the
    `openai` client spends ~25 ms validating a 1,000-id prompt before it sends anything)."""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "stream": True,
            "ignore_eos": True}  # fmt: skip
    t0 = time.perf_counter()
    last = t0
    async with s.post(url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if line.startswith(b"data: {"):
                last = time.perf_counter()
    return last - t0


async def machine_balance(
    url: str, model: str, runs: int = 3, seed: int | None = None
) -> MachineBalance:
    """`MachineBalance` of the server at `url` (`balance_from`): medians over `runs` rounds
    (after one unmeasured round) of the `BALANCE_PROBES` (the median stream of each), random
    token ids (`seed` None: fresh ones every call, since a server caches the prefixes of what
    it was sent before and a second probe with the same prompts would skip their prefill).
    About 5 s on the reference machine, 15 s where its GEMMs are 5x slower."""
    import aiohttp

    rng = random.Random(seed)
    times: list[list[float]] = [[] for _ in BALANCE_PROBES]
    async with aiohttp.ClientSession() as s:
        for _ in range(runs + 1):
            for out, (b, p, tokens) in zip(times, BALANCE_PROBES, strict=True):
                prompts = [random_prompt(rng, p) for _ in range(b)]
                sent = (_raw_ttlt(s, url, model, x, tokens) for x in prompts)
                ttlts = await asyncio.gather(*sent)
                out.append(statistics.median(ttlts))
    return balance_from([statistics.median(t[1:]) for t in times])


async def _speed(url: str, model: str) -> float:
    return await speed_factor(url, model, await profile_probe())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadgen.engine.fit_cpu", description=__doc__)
    ap.add_argument("--url", help="a running vLLM CPU server (default: start one)")
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--runs", type=int, default=3, help="measure this often; median per row")
    ap.add_argument(
        "--window-correction", action="store_true",
        help="with --url: also correct the fit on a replayed window (follows the current load)",
    )  # fmt: skip
    ap.add_argument("--rows", type=Path, help="fit these saved rows instead of measuring")
    ap.add_argument(
        "--speed", action="store_true",
        help="with --url: only print the --time-scale at which the committed profile matches it",
    )  # fmt: skip
    args = ap.parse_args(argv)
    if args.speed:
        if not args.url:
            ap.error("--speed needs --url")
        scale = asyncio.run(_speed(args.url, args.model))
        print(json.dumps({"time_scale": round(scale, 3)}))
        return 0
    if args.rows:
        rows = json.loads(args.rows.read_text())
    elif args.url:
        rows = _repeat(args.url, args.model, args.runs)
    else:
        from loadgen.vllm_real import RealVllm

        with RealVllm() as server:
            rows = _repeat(server.url, args.model, args.runs)
    if not args.rows:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")
    coefs = fit(rows)
    print(json.dumps(coefs))
    if args.url and args.window_correction:
        print(json.dumps(asyncio.run(window_correction(args.url, args.model, coefs))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
