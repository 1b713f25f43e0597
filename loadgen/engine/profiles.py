"""Latency profiles: how long one engine iteration takes, in seconds of virtual time.

A profile sees an iteration's shape only: how many sequences decode one token (`n_decode`),
their total context (`decode_context`, tokens already in KV summed over those sequences) and
how many prompt tokens are prefilled (`prefill_tokens`, whole prompts or chunks). Profiles are
registered by stable name with `@register_profile`; a second registration of a name is an
error. Add one by subclassing `LatencyProfile` (a CPU profile, another GPU) and registering it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, TypeVar

from policies.cost import LinearProfile

_PROFILES: dict[str, type[LatencyProfile]] = {}

P = TypeVar("P", bound="type[LatencyProfile]")


class LatencyProfile:
    """Iteration time of an engine. Subclasses are stateless and cheap to build.

    `grid_s`: when set, iterations start on multiples of this many seconds (a discrete-step
    model such as the portability paper's); an idle engine waits for the next grid point.
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    grid_s: ClassVar[float | None] = None

    def request_overhead_s(self, n_running: int) -> float:
        """Wall time between a request reaching the server and reaching the engine while
        `n_running` requests stream (the API server's own work, done beside the engine's
        iterations). The emulator delays each request by it; the simulator, which models the
        engine alone, ignores it. Default: none."""
        return 0.0

    def iteration_s(self, n_decode: int, decode_context: int, prefill_tokens: int) -> float:
        """Seconds for one iteration of the given shape (never called with an empty one)."""
        raise NotImplementedError

    def decode_run_s(self, n_decode: int, decode_context: int, steps: int) -> float:
        """Seconds for `steps` consecutive pure-decode iterations of the same sequences.

        Each iteration adds one token to each sequence, so the context grows by `n_decode`
        per iteration. Subclasses with a closed form override this; the default sums.
        """
        return sum(
            self.iteration_s(n_decode, decode_context + j * n_decode, 0) for j in range(steps)
        )

    def cost_profile(self, batch: int, context: int = 1024) -> LinearProfile:
        """What one request costs this engine, as the `time` cost model reads it.

        A request decoding among `batch` sequences pays its share of each decode iteration:
        the fixed part split `batch` ways plus its own marginal terms; the context term is the
        marginal cost of one more token of context (measured between 0 and `context` tokens
        per sequence); its prefill is the time of its prompt run alone. So the engine time of
        I prompt and O output tokens is prefill(I) + O·step + c·(I·O + O(O−1)/2)."""
        full = self.iteration_s(batch, 0, 0)
        step_s = full / batch
        context_s = (self.iteration_s(batch, batch * context, 0) - full) / (batch * context)
        base = self.iteration_s(0, 0, 1)
        per_tok = (self.iteration_s(0, 0, 1 + context) - base) / context
        return LinearProfile(base, per_tok, step_s, context_s)

    def steps_within(self, n_decode: int, decode_context: int, budget_s: float) -> int:
        """Smallest k ≥ 1 such that k pure-decode iterations take at least `budget_s`."""
        if budget_s <= 0:
            return 1
        lo, hi = 1, 1
        while self.decode_run_s(n_decode, decode_context, hi) < budget_s:
            lo, hi = hi + 1, hi * 2
        while lo < hi:  # bisect the smallest k with run time >= budget
            mid = (lo + hi) // 2
            if self.decode_run_s(n_decode, decode_context, mid) < budget_s:
                lo = mid + 1
            else:
                hi = mid
        return lo


def register_profile(cls: P) -> P:
    """Class decorator: add a latency profile under its `name` (loud on duplicates)."""
    if not cls.name or not cls.description:
        raise ValueError(f"{cls.__qualname__} needs a name and a description")
    if cls.name in _PROFILES:
        raise ValueError(f"latency profile {cls.name!r} registered twice")
    _PROFILES[cls.name] = cls
    return cls


def profile_names() -> list[str]:
    """All registered profile names, sorted."""
    return sorted(_PROFILES)


def make_profile(name: str) -> LatencyProfile:
    """A fresh instance of the profile registered under `name`."""
    try:
        cls = _PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown latency profile {name!r}; known: {profile_names()}") from None
    return cls()


class Scaled(LatencyProfile):
    """`inner` on a machine `factor` times slower (0.7: 30% faster): every time, the request
    overhead included, multiplied by `factor`. The simulator's counterpart of the emulator's
    time scale, e.g. at the speed `loadgen.engine.fit_cpu.speed_factor` measured on a server.
    Not for grid profiles (a discrete-step model has no speed)."""

    name = "scaled"
    description = "another profile at a measured speed"

    def __init__(self, inner: LatencyProfile, factor: float) -> None:
        if inner.grid_s is not None:
            raise ValueError(f"{inner.name!r} is a discrete-step profile; it cannot be scaled")
        if not factor > 0:
            raise ValueError("a profile's speed factor must be positive")
        self.inner, self.factor = inner, factor

    def request_overhead_s(self, n_running: int) -> float:
        return self.inner.request_overhead_s(n_running) * self.factor

    def iteration_s(self, n_decode: int, decode_context: int, prefill_tokens: int) -> float:
        return self.inner.iteration_s(n_decode, decode_context, prefill_tokens) * self.factor

    def decode_run_s(self, n_decode: int, decode_context: int, steps: int) -> float:
        return self.inner.decode_run_s(n_decode, decode_context, steps) * self.factor

    def steps_within(self, n_decode: int, decode_context: int, budget_s: float) -> int:
        return self.inner.steps_within(n_decode, decode_context, budget_s / self.factor)


@register_profile
class LsspConstant(LatencyProfile):
    """The portability paper's model: every iteration takes 1 ms, prefill is free."""

    name = "lssp-constant"
    description = "1 ms per iteration whatever its shape (LSSP paper's discrete-step model)"
    grid_s = 0.001
    step_s: ClassVar[float] = 0.001

    def iteration_s(self, n_decode: int, decode_context: int, prefill_tokens: int) -> float:
        return self.step_s

    def decode_run_s(self, n_decode: int, decode_context: int, steps: int) -> float:
        return steps * self.step_s

    def steps_within(self, n_decode: int, decode_context: int, budget_s: float) -> int:
        return max(1, math.ceil(budget_s / self.step_s - 1e-6))


@dataclass(frozen=True, slots=True)
class H200Coefficients:
    """Fitted by `loadgen.engine.fit_h200` (milliseconds; see its docstring for the model).

    Defaults: the Llama-3.1-8B shape. The mixed regime is a + c·ΣL + d·P (+ b·B where the shape
    has no mixed measurements and the mixed regime is the additive rule)."""

    decode_a_ms: float = 5.08329
    decode_per_seq_ms: float = 0.0140837
    decode_per_ctx_ms: float = 2.78904e-05
    prefill_a_ms: float = 5.1366
    prefill_per_tok_ms: float = 0.0185966
    prefill_per_tok2_ms: float = 1.23e-06
    mixed_a_ms: float = 2.92403
    mixed_per_seq_ms: float = 0.0
    mixed_per_ctx_ms: float = 5.09483e-05
    mixed_per_tok_ms: float = 0.0241669


H200_LLAMA3_8B = H200Coefficients()
H200_QWEN3_32B = H200Coefficients(
    decode_a_ms=18.3107,
    decode_per_seq_ms=0.0644588,
    decode_per_ctx_ms=5.1713e-05,
    prefill_a_ms=16.1543,
    prefill_per_tok_ms=0.0866292,
    prefill_per_tok2_ms=4.08984e-06,
    # no mixed measurements for this shape: decode fit + the prefill's per-token term
    mixed_a_ms=18.3107,
    mixed_per_seq_ms=0.0644588,
    mixed_per_ctx_ms=5.1713e-05,
    mixed_per_tok_ms=0.0866292,
)


@register_profile
class H200Llama3(LatencyProfile):
    """One H200, Llama-3.1-8B shape, bf16 (kernel-level; no paging or scheduler overhead)."""

    name = "h200-llama3-8b"
    description = "H200, Llama-3.1-8B shape: fit of REFERENCE.md §6 measurements (max error 8%)"
    k: ClassVar[H200Coefficients] = H200_LLAMA3_8B

    def iteration_s(self, n_decode: int, decode_context: int, prefill_tokens: int) -> float:
        k = self.k
        if prefill_tokens == 0:
            ms = (
                k.decode_a_ms
                + k.decode_per_seq_ms * n_decode
                + k.decode_per_ctx_ms * decode_context
            )
        elif n_decode == 0:
            p = prefill_tokens
            ms = k.prefill_a_ms + k.prefill_per_tok_ms * p + k.prefill_per_tok2_ms * p * p
        else:
            ms = (
                k.mixed_a_ms
                + k.mixed_per_seq_ms * n_decode
                + k.mixed_per_ctx_ms * decode_context
                + k.mixed_per_tok_ms * prefill_tokens
            )
        return ms / 1000.0

    def decode_run_s(self, n_decode: int, decode_context: int, steps: int) -> float:
        # Σ_j (a + b·n + c·(ctx + j·n)) = k·f(ctx) + c·n·k(k−1)/2
        first = self.iteration_s(n_decode, decode_context, 0)
        growth = self.k.decode_per_ctx_ms * n_decode * steps * (steps - 1) / 2 / 1000.0
        return steps * first + growth


@register_profile
class H200Qwen3(H200Llama3):
    """One H200, Qwen3-32B shape, bf16: the paper's larger model (kernel-level, as above).

    Mixed iterations use the additive rule (no mixed measurements for this shape). Its KV
    capacity on one H200 is the engine configuration's business (`h200-qwen3-32b`)."""

    name = "h200-qwen3-32b"
    description = "H200, Qwen3-32B shape: fit of REFERENCE.md §6 measurements (max error 7.5%)"
    k: ClassVar[H200Coefficients] = H200_QWEN3_32B


@dataclass(frozen=True, slots=True)
class CpuTinyCoefficients:
    """Fitted by `loadgen.engine.fit_cpu` on the vLLM CPU build serving the tiny model
    (milliseconds; B decodes, ΣL their context, P prefill tokens), the server started as
    `loadgen.vllm_real` starts it (model worker inside the engine-core process). Measured
    2026-11-30 on the otherwise idle 2-core machine: a linear fit of microbenchmark medians
    (3 passes; max relative error 21%: a 4.40, b 0.486, c 0, d 0.0503, e 4.99, f 0.881), then
    corrected on the calibration window (seed 1) replayed 3 times against a warmed-up server:
    iteration terms × 1.39 (median TPOT 7.97 ms measured vs 5.72 emulated: streaming many
    requests costs the API server more than the microbenchmarks see) and request overhead
    + 0.6 ms (median TTFT 43.7 ms). Rows: `loadgen/engine/cpu_tiny_vllm_measurements.json`."""

    a_ms: float = 6.13
    per_seq_ms: float = 0.677
    per_ctx_ms: float = 0.0
    per_prefill_tok_ms: float = 0.0701
    request_overhead_ms: float = 5.57
    """Per-request API-server latency before the engine sees the request (fitted as the
    fixed part of a lone request's TTFT beyond one iteration)."""
    overhead_per_running_ms: float = 0.881
    """Extra request overhead per request already streaming (the API server is busier)."""


CPU_TINY_VLLM = CpuTinyCoefficients()


@register_profile
class CpuTinyVllm(LatencyProfile):
    """vLLM CPU build (0.32.0, 2 cores) serving the tiny 4-layer Llama of REFERENCE.md §7.

    One linear model for every iteration, a + b·B + c·ΣL + d·P (ms), plus a per-request
    overhead e + f·(requests streaming) before the engine sees a request, all as a client
    sees them."""

    name = "cpu-tiny-vllm"
    description = "vLLM CPU build, tiny Llama on 2 cores: fit of loadgen.engine.fit_cpu"

    def __init__(self, k: CpuTinyCoefficients = CPU_TINY_VLLM) -> None:
        self.k = k

    def request_overhead_s(self, n_running: int) -> float:
        k = self.k
        return (k.request_overhead_ms + k.overhead_per_running_ms * n_running) / 1000.0

    def iteration_s(self, n_decode: int, decode_context: int, prefill_tokens: int) -> float:
        k = self.k
        ms = k.a_ms + k.per_seq_ms * n_decode + k.per_ctx_ms * decode_context
        return (ms + k.per_prefill_tok_ms * prefill_tokens) / 1000.0

    def decode_run_s(self, n_decode: int, decode_context: int, steps: int) -> float:
        first = self.iteration_s(n_decode, decode_context, 0)
        growth = self.k.per_ctx_ms * n_decode * steps * (steps - 1) / 2 / 1000.0
        return steps * first + growth
