"""An engine's iteration-time curve, fitted from what the engine reports: pure.

Continuous-batching engines (vLLM, the engine model) run one iteration after another; each
decodes one token for every running request and prefills some prompt tokens. Every profile
this project has measured is close to linear in the iteration's shape (docs/policies.md,
"The self-tuning cap"):

    t_iter = alpha + beta * B + kappa * C + pi * P

with B the running requests, C their summed context (tokens in KV) and P the prompt tokens
prefilled in the iteration; alpha is the fixed cost of an iteration (weights read once, the
scheduler's own work). `EngineFit` estimates (alpha, beta, kappa, pi) by weighted least squares
over every busy interval between two readings of the engine's counters (`Interval`), old
intervals fading with a half-life so a change of load is followed.

Two things follow from the fit:

- **The throughput curve and the efficient batch.** At the current mix (context per request
  l, prompt tokens per iteration per request p), decode throughput at batch B is
  T(B) = B / (alpha + beta' * B) with beta' = beta + kappa * l + pi * p, rising to the plateau
  1 / beta'. The smallest batch within a fraction f of the plateau is
  B_f = f / (1 - f) * alpha / beta' (`efficient_batch`), with its standard error from the
  fit's covariance (delta method), so a caller knows when the curve is still uncertain.
- **The engine's cost per request** (`profile`): the `LinearProfile` the `time` cost model and
  SageSched's preemption rule read, at the batch the cap runs.

`EngineSample` is one reading of an engine's own series (vLLM's `/metrics`, the engine
model's state); `interval_between` turns two readings into an `Interval` when the engine ran
one batch size throughout, and `merge` joins consecutive ones.

Time is a number passed in; nothing here reads a clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from policies.cost import LinearProfile

FEATURES = ("alpha", "beta", "kappa", "pi")
"""Coefficient names, in the regression's column order (seconds, per request, per context
token, per prompt token)."""


@dataclass(frozen=True, slots=True)
class Interval:
    """What the engine did between two readings of its counters (it ran throughout)."""

    seconds: float
    iterations: float
    """Engine iterations (vLLM's `iteration_tokens_total` count, or tokens / batch)."""
    batch: float
    """Mean requests decoding per iteration (output tokens / iterations where the engine counts
    its iterations, else the running requests at the two readings)."""
    prompt_tokens: float
    """Prompt tokens prefilled in the interval."""
    context_tokens: float | None = None
    """Mean summed context of the decoding requests (from KV usage x capacity), if known."""
    running: float | None = None
    """Mean requests in the engine's batch (decoding or prefilling; None: as `batch`)."""
    token_s: float | None = None
    """Mean seconds between two output tokens of a request (vLLM's inter-token latency), if
    known: the iteration time weighted by batch, measured per token, so free of the
    rounding of a few iterations counted between two readings. The weighting leans a little
    toward decode-only iterations (an iteration that prefills a newcomer has one decoding
    request fewer), so the per-prompt-token cost it gives reads low by roughly one part in
    the batch (measured in simulation: 0.87 of the truth at batch 8, 0.96 at 48)."""

    @property
    def in_batch(self) -> float:
        """Mean requests in the engine's batch."""
        return self.batch if self.running is None else self.running

    def row(self) -> tuple[list[float], float]:
        """(features per iteration, seconds per iteration)."""
        n = self.iterations
        ctx = 0.0 if self.context_tokens is None else self.context_tokens
        y = self.seconds / n if self.token_s is None else self.token_s
        return [1.0, self.batch, ctx, self.prompt_tokens / n], y


@dataclass(frozen=True, slots=True)
class EngineSample:
    """One reading of an engine's own metrics; None = the series is unknown."""

    waiting: float | None = None
    """Requests waiting inside the engine (vLLM `num_requests_waiting`)."""
    kv_usage: float | None = None
    """KV-cache usage in [0, 1] (vLLM `kv_cache_usage_perc`)."""
    generation_tokens: float | None = None
    """Cumulative output tokens generated (vLLM `generation_tokens_total`)."""
    running: float | None = None
    """Requests in the engine's running batch (vLLM `num_requests_running`)."""
    prompt_tokens: float | None = None
    """Cumulative prompt tokens prefilled (vLLM `prompt_tokens_total`)."""
    iterations: float | None = None
    """Cumulative engine iterations (the count of vLLM's `iteration_tokens_total`)."""
    kv_capacity_tokens: float | None = None
    """Tokens the KV cache holds in all (vLLM `cache_config_info`: blocks × block size)."""
    token_gap_s: float | None = None
    """Cumulative seconds between consecutive output tokens of each request (the sum of
    vLLM's `inter_token_latency_seconds`)."""
    token_gaps: float | None = None
    """How many such gaps (its count)."""


@dataclass(slots=True)
class Reading:
    """One sample of an engine's counters and the gateway's in-flight count then."""

    now: float
    sample: EngineSample
    inflight: int


STEADY_BATCH = 1.25
"""Without an iteration counter, an interval is fitted only if the batch at its ends differs
by at most this factor (its mean batch is then known from the ends)."""
COUNTED_BATCH = 2.0
"""With an iteration counter the mean batch is counted (output tokens / iterations), so the
batch may move within an interval; this bounds how far, since a batch that fell to a few
requests may have let the engine idle between two readings."""


def interval_between(last: Reading, now: Reading) -> Interval | None:
    """What the engine did between two readings, if it ran throughout and its counters
    moved forward; None otherwise.

    An iteration's time is linear in its shape, so the mean iteration of an interval is the
    line at the interval's mean shape: where the engine counts its iterations the mean batch
    (output tokens per iteration) and prompt tokens per iteration are exact, whatever the
    batch did in between."""
    a, b = last.sample, now.sample
    dt = now.now - last.now
    if a.generation_tokens is None or b.generation_tokens is None or dt <= 0:
        return None
    tokens = b.generation_tokens - a.generation_tokens
    if tokens <= 0:
        return None
    if a.running is not None and b.running is not None:
        ends = (a.running, b.running)
    else:
        ends = (float(last.inflight), float(now.inflight))
    iterations = _delta(a.iterations, b.iterations)
    counted = iterations is not None and iterations > 0
    steady = max(ends) <= (COUNTED_BATCH if counted else STEADY_BATCH) * min(ends)
    if min(ends) < 1 or not steady:
        # idle at one end (part of the interval may have been idle), or the batch moved
        # (after a cap change or while a burst drains) further than its mean can be told
        return None
    running = (ends[0] + ends[1]) / 2
    if iterations is None or iterations <= 0:
        batch, iterations = running, tokens / running
    else:
        # every decoding request adds one token per iteration; the batch never passed the
        # larger end, and the requests in it were at least the decoding ones
        batch = min(tokens / iterations, max(ends))
        running = max(running, batch)
    prompt = _delta(a.prompt_tokens, b.prompt_tokens) or 0.0
    context = None
    if (
        a.kv_usage is not None
        and b.kv_usage is not None
        and b.kv_capacity_tokens is not None
        and b.kv_capacity_tokens > 0
    ):
        # KV per running request at the two readings, times the interval's decoding batch
        per_request = (a.kv_usage + b.kv_usage) * b.kv_capacity_tokens / (ends[0] + ends[1])
        context = per_request * batch
    token_s = None
    gaps = _delta(a.token_gaps, b.token_gaps)
    gap_s = _delta(a.token_gap_s, b.token_gap_s)
    if gaps is not None and gap_s is not None and gaps >= MIN_GAPS:
        token_s = gap_s / gaps
    return Interval(dt, iterations, batch, max(prompt, 0.0), context, running, token_s)


MIN_GAPS = 16
"""Inter-token gaps an interval needs before their mean stands for its iteration time."""


def same_batch(a: float, b: float) -> bool:
    return max(a, b) <= STEADY_BATCH * min(a, b)


def merge(a: Interval, b: Interval) -> Interval:
    """Two consecutive intervals as one (batch and context weighted by iterations)."""
    n = a.iterations + b.iterations
    context = None
    if a.context_tokens is not None and b.context_tokens is not None:
        context = (a.context_tokens * a.iterations + b.context_tokens * b.iterations) / n
    return Interval(
        seconds=a.seconds + b.seconds,
        iterations=n,
        batch=(a.batch * a.iterations + b.batch * b.iterations) / n,
        prompt_tokens=a.prompt_tokens + b.prompt_tokens,
        context_tokens=context,
        running=(a.in_batch * a.iterations + b.in_batch * b.iterations) / n,
        token_s=None
        if a.token_s is None or b.token_s is None
        else (
            (a.token_s * a.batch * a.iterations + b.token_s * b.batch * b.iterations)
            / (a.batch * a.iterations + b.batch * b.iterations)
        ),
    )


def _delta(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b < a:
        return None
    return b - a


class EngineFit:
    """Weighted least squares of an engine's iteration time on its shape.

    Call `add` once per busy interval, in time order. Each interval is one observation that
    fades with `half_life_s` of later observed time; errors are taken as relative. Not
    thread-safe.
    """

    def __init__(
        self, half_life_s: float = 300.0, mix_half_life_s: float = 30.0, ridge: float = 1e-9
    ) -> None:
        """`half_life_s`: of the coefficients (the engine changes rarely); `mix_half_life_s`:
        of the traffic mix the efficient batch is computed at (it changes with the load, but
        not with the phases of one burst: its prefill-heavy start and decode-only end)."""
        if half_life_s <= 0 or mix_half_life_s <= 0:
            raise ValueError("need half-lives > 0")
        self.half_life_s = half_life_s
        self.mix_half_life_s = mix_half_life_s
        self._ridge = ridge
        k = len(FEATURES)
        self._xx = np.zeros((k, k))
        self._xy = np.zeros(k)
        self._yy = 0.0
        self._w = 0.0
        self._w2 = 0.0
        self._mix = np.zeros(4)
        """Faded token sums (batch x iterations, context x iterations, prompt tokens, requests
        in the batch x iterations); with `_mix_w` (iterations) they give the traffic's mix as
        ratios of sums, so a burst's prefill-only start and decode-only end average to its
        prompt / output ratio."""
        self._mix_w = 0.0
        self._ctx_known = False
        self._span = [math.inf, 0.0]
        """Smallest and largest batch observed (not faded)."""
        self._solved: tuple[np.ndarray, np.ndarray] | None = None

    # -- observations -----------------------------------------------------------------------

    def add(self, interval: Interval) -> None:
        """One busy interval. Ignored when it ran no iteration or no time."""
        if interval.iterations <= 0 or interval.seconds <= 0 or interval.batch <= 0:
            return
        fade = 0.5 ** (interval.seconds / self.half_life_s)
        x_list, y = interval.row()
        x = np.asarray(x_list)
        # errors are relative (a 5% jitter at batch 500 is not 50x the one at batch 10) and
        # shrink with the iterations an interval spans (a count of 2 is ±50% from rounding
        # alone, one of 20 ±5%): each row is weighted by iterations / y^2
        n = interval.iterations
        r = n / (y * y)
        self._xx = self._xx * fade + r * np.outer(x, x)
        self._xy = self._xy * fade + r * x * y
        self._yy = self._yy * fade + n
        self._w = self._w * fade + 1.0
        self._w2 = self._w2 * fade * fade + 1.0
        mix_fade = 0.5 ** (interval.seconds / self.mix_half_life_s)
        ctx = 0.0 if interval.context_tokens is None else interval.context_tokens
        self._mix = self._mix * mix_fade + np.array(
            [interval.batch * n, ctx * n, interval.prompt_tokens, interval.in_batch * n]
        )
        self._mix_w = self._mix_w * mix_fade + n
        self._ctx_known = self._ctx_known or interval.context_tokens is not None
        self._span = [min(self._span[0], interval.batch), max(self._span[1], interval.batch)]
        self._solved = None

    @property
    def observations(self) -> float:
        """Effective number of observations ((sum w)^2 / sum w^2 of the faded weights)."""
        return self._w * self._w / self._w2 if self._w2 > 0 else 0.0

    @property
    def batch_span(self) -> tuple[float, float]:
        """(smallest, largest) mean batch seen; (inf, 0) before the first interval."""
        return self._span[0], self._span[1]

    # -- the fit ----------------------------------------------------------------------------

    def coefficients(self) -> dict[str, float] | None:
        """(alpha, beta, kappa, pi) in seconds, or None before the fit is determined.

        A negative coefficient is not physical (more work never makes an iteration
        shorter): its column is dropped and the rest refitted."""
        solved = self._solve()
        return None if solved is None else dict(zip(FEATURES, solved[0].tolist(), strict=True))

    def mix(self) -> tuple[float, float, float]:
        """Recent (batch, context per request, prompt tokens per iteration per request)."""
        if self._mix_w <= 0:
            return 0.0, 0.0, 0.0
        batch, ctx, prompt, _ = (self._mix / self._mix_w).tolist()
        per = max(batch, 1e-9)
        return batch, ctx / per, prompt / per

    def in_batch_per_decoding(self) -> float:
        """Recent requests in the engine's batch per decoding one (>= 1: the rest are being
        prefilled); converts a decoding batch into the in-flight count that keeps it."""
        if self._mix[0] <= 0:
            return 1.0
        return max(1.0, float(self._mix[3] / self._mix[0]))

    def step_s(
        self, batch: float, context_tokens: float = 0.0, prompt_tokens: float = 0.0
    ) -> float | None:
        """Predicted seconds of one iteration of this shape (None before a fit)."""
        solved = self._solve()
        if solved is None:
            return None
        return float(solved[0] @ np.array([1.0, batch, context_tokens, prompt_tokens]))

    def residual(self, interval: Interval) -> tuple[float, float] | None:
        """(relative error of the fit on `interval`, relative standard error of the fit's
        prediction there), or None before a fit. The second is large where the fit
        extrapolates (a mix of context and batch it has not seen)."""
        solved = self._solve()
        if solved is None or interval.iterations <= 0:
            return None
        theta, cov = solved
        x_list, y = interval.row()
        x = np.asarray(x_list)
        predicted = float(theta @ x)
        if predicted <= 0:
            return None
        se = math.sqrt(max(float(x @ cov @ x), 0.0)) / predicted
        return (y - predicted) / predicted, se

    def slope(self) -> float | None:
        """beta' (seconds per extra running request at the recent mix), None before a fit."""
        c = self.coefficients()
        if c is None:
            return None
        _, ctx, prompt = self.mix()
        return c["beta"] + c["kappa"] * ctx + c["pi"] * prompt

    def efficient_batch(self, fraction: float) -> tuple[float, float] | None:
        """(B_f, relative standard error) for throughput `fraction` of the plateau at the
        recent mix, as requests in the engine's batch (the decoding batch B_f plus the share
        being prefilled beside it); None while the curve shows no plateau (beta' <= 0) or no
        fixed cost."""
        if not 0 < fraction < 1:
            raise ValueError("need 0 < fraction < 1")
        solved = self._solve()
        if solved is None:
            return None
        theta, cov = solved
        _, ctx, prompt = self.mix()
        grad_slope = np.array([0.0, 1.0, ctx, prompt])
        alpha, slope = float(theta[0]), float(theta @ grad_slope)
        if alpha <= 0 or slope <= 0:
            return None
        ratio = fraction / (1 - fraction)
        batch = ratio * alpha / slope * self.in_batch_per_decoding()
        # d ln B / d theta = e_alpha / alpha - grad_slope / slope
        g = np.array([1.0 / alpha, 0.0, 0.0, 0.0]) - grad_slope / slope
        var = float(g @ cov @ g)
        return batch, math.sqrt(max(var, 0.0))

    def profile(self, batch: float) -> LinearProfile | None:
        """The cost of one request decoding among `batch` running ones (the fixed cost shared
        `batch` ways), as the `time` cost model reads it; None before a fit."""
        c = self.coefficients()
        if c is None:
            return None
        b = max(batch, 1.0)
        return LinearProfile(
            prefill_base_s=c["alpha"],
            prefill_s_per_token=c["pi"],
            step_s=c["alpha"] / b + c["beta"],
            context_s_per_token=c["kappa"],
        )

    def _solve(self) -> tuple[np.ndarray, np.ndarray] | None:
        if self._solved is not None:
            return self._solved
        k = len(FEATURES)
        # a column never observed (no context series, no prompt counter) is left out
        active = [j for j in range(k) if self._xx[j, j] > 0 and (j != 2 or self._ctx_known)]
        if self.observations < len(active) + 1:
            return None
        scale = np.sqrt(np.maximum(np.diag(self._xx), 1e-300))
        while active:
            idx = np.array(active)
            xx = self._xx[np.ix_(idx, idx)] / np.outer(scale[idx], scale[idx])
            xx = xx + self._ridge * np.eye(len(idx))
            xy = self._xy[idx] / scale[idx]
            try:
                inv = np.linalg.inv(xx)
            except np.linalg.LinAlgError:
                return None
            beta = inv @ xy
            negative = [active[i] for i in range(len(active)) if beta[i] < 0 and active[i] != 0]
            if negative:
                active.remove(min(negative, key=lambda j: beta[active.index(j)]))
                continue
            theta = np.zeros(k)
            theta[idx] = beta / scale[idx]
            rss = float(self._yy - 2 * theta @ self._xy + theta @ self._xx @ theta)
            # faded weights: RSS / (n_eff - k) is the sandwich covariance's scale
            sigma2 = max(rss, 0.0) / max(self.observations - len(idx), 1.0)
            cov = np.zeros((k, k))
            cov[np.ix_(idx, idx)] = sigma2 * inv / np.outer(scale[idx], scale[idx])
            self._solved = (theta, cov)
            return self._solved
        return None

    # -- memory -----------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The fit's sufficient statistics (JSON-ready): `from_dict` restores it exactly."""
        return {
            "half_life_s": self.half_life_s,
            "mix_half_life_s": self.mix_half_life_s,
            "mix_w": self._mix_w,
            "xx": self._xx.tolist(),
            "xy": self._xy.tolist(),
            "yy": self._yy,
            "w": self._w,
            "w2": self._w2,
            "mix": self._mix.tolist(),
            "context_known": self._ctx_known,
            "span": list(self._span) if math.isfinite(self._span[0]) else None,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineFit:
        """Restore a fit saved by `to_dict`. Raises ValueError on a malformed record."""
        try:
            fit = cls(float(data["half_life_s"]), float(data["mix_half_life_s"]))
            fit._mix_w = float(data["mix_w"])
            fit._xx = np.asarray(data["xx"], dtype=np.float64).reshape(len(FEATURES), -1)
            fit._xy = np.asarray(data["xy"], dtype=np.float64).reshape(len(FEATURES))
            fit._yy, fit._w, fit._w2 = float(data["yy"]), float(data["w"]), float(data["w2"])
            fit._mix = np.asarray(data["mix"], dtype=np.float64).reshape(4)
            fit._ctx_known = bool(data["context_known"])
            if data.get("span"):
                fit._span = [float(data["span"][0]), float(data["span"][1])]
        except (KeyError, TypeError, IndexError) as e:
            raise ValueError(f"not an engine fit: {e}") from None
        if fit._xx.shape != (len(FEATURES), len(FEATURES)):
            raise ValueError("not an engine fit: wrong shape")
        return fit


__all__ = [
    "FEATURES",
    "EngineFit",
    "EngineSample",
    "Interval",
    "Reading",
    "interval_between",
    "merge",
    "same_batch",
]
