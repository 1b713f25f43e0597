"""The in-flight cap that tunes itself, and vLLM priority levels: pure control laws.

Why a cap: vLLM admits every request into its own FCFS queue, so a gateway policy orders
anything only while the backlog waits in the gateway. Too small a cap throttles the engine;
too large a cap leaves the backlog in vLLM's queue. The right cap is the engine's *efficient
batch*: the smallest batch whose throughput is within `plateau_fraction` of what the engine
can do at all, as long as it fits in KV and nothing waits inside the engine.

`CapController` estimates it from what the engine itself reports (vLLM's `/metrics` in the
gateway; the engine model's state in the simulator), one `observe` per sample:

1. **Fit the curve.** Every interval between two samples in which the engine ran is one
   observation of its iteration time against the batch it ran, the context it held and the
   prompt tokens it prefilled (`policies.engine_fit.EngineFit`: weighted least squares over
   every sample seen, old ones fading with `half_life_s`). The fit gives the throughput curve
   T(B) = B / (alpha + beta' B) at the current mix, its plateau 1 / beta', and the efficient
   batch B_f = f / (1 - f) · alpha / beta' with a standard error.
2. **Limits.** vLLM's waiting queue above `waiting_high` in two samples in a row (one prompt
   waiting a step for the token budget is no full batch): the engine runs only about
   `inflight - waiting` (its `max_num_seqs`, or what its KV admits), so the cap drops to that
   plus `waiting_high`. KV usage above `kv_high`: the engine is about to preempt; the cap
   shrinks by `backoff`. Either way the lowered cap is a ceiling for a while (`limit_hold_s`
   after a KV limit, `queue_hold_s` after a queue).
3. **Set the cap from the curve** once B_f's relative standard error is at most
   `confident_error`: the cap goes to B_f (moves smaller than `deadband` are not made, so a
   settled cap stays put). While the curve is uncertain the controller explores. From a cold
   start (slow start, a sample every `slow_start_interval_s`, while the cap binds) it first
   gets the fit an estimate without letting the backlog go: one step to a second batch size
   (`MIN_SPAN` below the cap, or above it where the floor is in the way), held until the fit
   has twice `min_observations`; the backlog the cap holds back is what the policy orders.
   Then it doubles the cap while the estimate is above half of it (or while the curve shows
   no plateau; with no fixed cost it halves), and then it alternates `explore_step` above
   and below the estimate, so the batch varies and the fit can tell the fixed cost from the
   per-request cost. Until the curve is trusted, both read the estimate discounted by its
   own uncertainty (`doubt` standard errors), so an uncertain curve errs toward the floor.
   Exploration goes on only while it can pay: if the fit's error, falling as one over the
   root of its evidence, would need more than `explore_horizon` further observations to be
   trusted (a noisy engine), the cap rests at that discounted estimate for
   `explore_rest_s` (doubling each time, up to `explore_rest_max_s`), then probes once above
   and below and judges again. So a curve that stays uncertain leaves the cap at one level,
   not alternating between probes.
4. **Remember.** `memory()` is the fit's state; a controller built with it (`memory=`) starts
   at the remembered efficient batch. If the engine no longer matches the remembered curve
   (the median relative error of the last `change_window` intervals above `change_error`:
   new hardware, new flags) the fit starts over and `changes` counts it.

A series the engine does not report is *unknown* (`None`), never 0: an unknown queue or KV
usage is no limit, without a token counter nothing is fitted and the cap grows like AIMD while
the engine shows no queue, and with nothing known at all the cap holds where it was
configured. A counter that goes backwards (engine restart) skips that interval.

Everything here is pure: time is a number passed in (wall seconds in the gateway, virtual
seconds in the simulator), so both run the same controller.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from policies.cost import LinearProfile
from policies.engine_fit import (
    EngineFit,
    EngineSample,
    Interval,
    Reading,
    interval_between,
    merge,
    same_batch,
)


@dataclass(frozen=True, slots=True)
class CapLaw:
    """Parameters of `CapController` (caps in requests, times in the caller's seconds)."""

    interval_s: float = 1.0
    """Seconds between samples (the caller samples every `CapController.interval_s`)."""
    slow_start_interval_s: float = 0.25
    """Seconds between samples while the curve is still unknown."""
    min_cap: int = 1
    max_cap: int = 1024
    uncertain_floor: int = 8
    """While the curve is not trusted, exploration does not take the cap below this (nor
    below the cap the controller started at, if that is smaller): too small a cap throttles
    the engine and the backlog grows without bound, too large a cap only hands part of the
    backlog to the engine's own FCFS queue, so an uncertain cap errs high. A trusted curve
    and the engine's queue and KV limits may still take it lower."""
    kv_high: float = 0.95
    """KV usage above which the cap shrinks (vLLM preempts when KV runs out)."""
    waiting_high: float = 2.0
    """Engine waiting requests above which the cap shrinks (a few may wait for one step)."""
    backoff: float = 0.125
    """Multiplicative decrease on a KV limit."""
    limit_hold_s: float = 30.0
    """A cap lowered by the KV limit is the most the curve may ask for during this long (KV
    room depends on the traffic's lengths, so it is looked at again)."""
    queue_confirm_s: float = 5.0
    """After slow start, how long the engine's queue must stay above `waiting_high` before it
    counts as a limit."""
    queue_hold_s: float = 600.0
    """The same for a cap lowered by the engine's queue after slow start (its `max_num_seqs`
    or KV admission changes with a restart, not with the traffic); a queue during slow start
    holds `limit_hold_s`."""
    plateau_fraction: float = 0.85
    """The efficient batch is the smallest whose throughput is this share of the plateau
    (elasticity of throughput to the batch 1 - f). Chosen on the real vLLM CPU build, whose
    iterations are dominated by prefill: its fitted curve puts 0.85 at a batch of ~8, the
    best fixed cap measured there (docs/validation.md)."""
    confident_error: float = 0.2
    """Relative standard error of the efficient batch below which the curve is trusted."""
    min_observations: float = 3.0
    """Intervals the fit needs before it is trusted at all."""
    explore_step: float = 0.5
    """While the curve is uncertain: relative distance above and below the estimate the cap
    alternates between."""
    doubt: float = 2.0
    """While the curve is uncertain, slow start and exploration read its efficient batch
    discounted by this many standard errors (B_f · exp(-doubt · se)): an uncertain curve errs
    toward the floor, where the gateway's order works, not above the knee, where the backlog
    leaves the gateway for the engine's own FCFS queue."""
    explore_horizon: float = 20.0
    """Further observations the fit may need to be trusted (projected from its error and
    evidence, the error falling as 1 / sqrt(evidence)) for exploring to go on; beyond, the
    cap rests at the discounted estimate."""
    explore_judged_after: float = 12.0
    """Observations the fit holds before exploration is judged (a projection from fewer is
    itself noise)."""
    explore_rest_s: float = 15.0
    """The first rest of an exploration that cannot pay; each further one doubles."""
    explore_rest_max_s: float = 240.0
    """The longest rest."""
    refine_step: float = 0.15
    """Once trusted, until its error halves: relative distance above and below the estimate
    the cap alternates between."""
    deadband: float = 0.1
    """Relative change of the efficient batch below which a settled cap is not moved."""
    slow_start_factor: float = 2.0
    """Growth per sample during slow start (cold, the curve not known yet)."""
    half_life_s: float = 300.0
    """Observed seconds after which an interval counts half in the fit."""
    change_window: int = 6
    """Intervals judged against the curve to tell that the engine changed."""
    change_error: float = 0.3
    """Relative error beyond which an interval is held out of the fit; a median error of the
    last `change_window` intervals beyond it says the engine is no longer the one the curve
    was fitted on."""
    busy_fraction: float = 0.9
    """The cap binds while at least this share of it is in flight."""
    min_iterations: float = 8.0
    """Engine iterations one observation of the curve spans (consecutive samples of one
    batch are merged until they do)."""

    def __post_init__(self) -> None:
        if self.slow_start_factor <= 1:
            raise ValueError("need slow_start_factor > 1")
        if not 1 <= self.min_cap <= self.max_cap:
            raise ValueError("need 1 <= min_cap <= max_cap")
        if self.uncertain_floor < 1:
            raise ValueError("need uncertain_floor >= 1")
        if self.interval_s <= 0 or self.slow_start_interval_s <= 0:
            raise ValueError("need interval_s > 0")
        if not 0 < self.plateau_fraction < 1:
            raise ValueError("need 0 < plateau_fraction < 1")
        if not 0 < self.explore_step < 1 or self.confident_error <= 0:
            raise ValueError("need 0 < explore_step < 1 and confident_error > 0")
        if self.doubt < 0:
            raise ValueError("need doubt >= 0")
        if self.explore_horizon < 0 or not 0 < self.explore_rest_s <= self.explore_rest_max_s:
            raise ValueError("need explore_horizon >= 0 and 0 < explore_rest_s <= its max")
        if not 0 < self.backoff < 1 or self.change_window < 2 or self.min_iterations <= 0:
            raise ValueError("need 0 < backoff < 1, change_window >= 2, min_iterations > 0")


class CapController:
    """One engine's cap. Call `observe` once per sample, in time order; read `cap`.

    `memory`: a previous controller's `memory()` for the same engine (a restart): the cap
    starts at the remembered efficient batch instead of `cap` when the remembered curve is
    trusted; an untrusted one only lends its evidence (the cap starts at `cap`, in slow
    start). A malformed memory is ignored.
    """

    def __init__(self, law: CapLaw, cap: int, memory: dict[str, Any] | None = None) -> None:
        self.law = law
        self.cap = self._clamp(cap)
        self.floor = min(self.cap, law.uncertain_floor)
        """The least cap exploration may set while the curve is not trusted."""
        self.fit = EngineFit(law.half_life_s)
        self.slow_start = True
        self._settled = False
        self.changes = 0
        """Times the engine stopped matching its curve and the fit started over."""
        self._last: Reading | None = None
        self._waiting: float | None = None
        """The engine queue at the previous sample."""
        self._queue_since: float | None = None
        """When the engine's queue was first seen above `waiting_high` (None: it is not)."""
        self._ceiling: tuple[int, float] | None = None
        """(cap, until) set by the last limit."""
        self._errors: deque[float] = deque(maxlen=law.change_window)
        """Relative errors of the last intervals against the curve."""
        self._suspects: deque[Interval] = deque(maxlen=law.change_window)
        """The last intervals held out of the fit as too far off the curve."""
        self._pending: Interval | None = None
        """Intervals of one batch gathered until they span `min_iterations`."""
        self._explore = 1
        """The exploration dither's last direction (+1 above the estimate, -1 below)."""
        self._observed = False
        """Has the fit had an observation at the current cap since it came into force?"""
        self._rest: tuple[int, float] | None = None
        """(cap, until) while an exploration that cannot pay rests."""
        self._rests = 0
        """Rests in a row (each doubles the next)."""
        self._probes_due = 0
        """Probes made after a rest before exploration is judged again."""
        if memory is not None:
            self._recall(memory)

    @property
    def interval_s(self) -> float:
        """Seconds until the caller should sample again."""
        return self.law.slow_start_interval_s if self.slow_start else self.law.interval_s

    def efficient_batch(self) -> tuple[float, float] | None:
        """(B_f, relative standard error) of the fitted curve, None while it has none (too
        few intervals, or all at nearly one batch: a fixed cost and a per-request cost cannot
        be told apart from one batch size)."""
        low, high = self.fit.batch_span
        if self.fit.observations < self.law.min_observations or high < MIN_SPAN * low:
            return None
        return self.fit.efficient_batch(self.law.plateau_fraction)

    def confident(self) -> bool:
        """Is the fitted curve trusted (it sets the cap)? Once trusted it stays so until its
        error doubles (hysteresis: an error hovering at the bound does not flip the cap
        between settling and exploring)."""
        est = self.efficient_batch()
        bound = self.law.confident_error * (2.0 if self._settled else 1.0)
        return est is not None and est[1] <= bound

    def profile(self) -> LinearProfile | None:
        """The engine's per-request cost at the current cap (the `time` cost model), once
        the curve is trusted; None before."""
        return self.fit.profile(self.cap) if self.confident() else None

    def iteration_curve(self) -> Callable[[int], float] | None:
        """Predicted seconds of one engine iteration at a running batch of B, at the recent
        mix (the time per output token of each running request: `policies.shares` bounds a
        batch by it), once the curve is trusted; None before."""
        coefficients, slope = self.fit.coefficients(), self.fit.slope()
        if not self.confident() or coefficients is None or slope is None:
            return None
        alpha = coefficients["alpha"]
        return lambda batch: alpha + slope * batch

    def memory(self) -> dict[str, Any] | None:
        """What a restarted controller needs (JSON-ready): the fit (all the evidence so far,
        so confidence builds across restarts) and the cap; None before any evidence."""
        if self.fit.observations < self.law.min_observations:
            return None
        return {"fit": self.fit.to_dict(), "cap": self.cap}

    def trace(self, sample: EngineSample, inflight: int) -> dict[str, Any]:
        """The controller's state after a sample, JSON-ready (the gateway logs it at DEBUG):
        enough to replay why the cap is where it is."""
        est = self.efficient_batch()
        coefficients = self.fit.coefficients()
        return {
            "cap": self.cap,
            "inflight": inflight,
            "sample": {k: v for k, v in asdict(sample).items() if v is not None},
            "slow_start": self.slow_start,
            "settled": self._settled,
            "rest": self._rest,
            "ceiling": self._ceiling,
            "efficient": None if est is None else [round(est[0], 2), round(est[1], 3)],
            "mix": [round(v, 3) for v in self.fit.mix()],
            "span": list(self.fit.batch_span),
            "observations": round(self.fit.observations, 2),
            "fit": None
            if coefficients is None
            else {k: float(f"{v:.3g}") for k, v in coefficients.items()},
        }

    def observe(self, now: float, sample: EngineSample, inflight: int) -> int:
        """One sample at time `now` with `inflight` requests of the gateway on this engine.
        Returns the (possibly new) cap."""
        law = self.law
        if sample == EngineSample():
            return self.cap  # nothing known (no metrics endpoint): keep the configured cap
        last, self._last = self._last, Reading(now, sample, inflight)
        interval = None if last is None else interval_between(last, self._last)
        if interval is None:
            self._flush()
        else:
            self._gather(interval)
        # a queue counts once it is seen twice in a row and, after slow start, for
        # `queue_confirm_s`: prompts waiting a few steps for the token budget (a burst's prefill
        # backlog) are no sign of a full batch; a `max_num_seqs` or KV admission limit stays
        last_waiting, self._waiting = self._waiting, sample.waiting
        waiting = sample.waiting is not None and sample.waiting > law.waiting_high
        if not waiting:
            self._queue_since = None
        elif self._queue_since is None:
            self._queue_since = now
        queued = (
            waiting
            and last_waiting is not None
            and last_waiting > law.waiting_high
            and (self.slow_start or now - (self._queue_since or now) >= law.queue_confirm_s)
        )
        full = sample.kv_usage is not None and sample.kv_usage > law.kv_high
        if queued or full:
            return self._limit(now, sample, inflight, last_waiting, full=full)
        if sample.generation_tokens is None:
            # no throughput series: plain AIMD growth while the engine has room
            binding = inflight >= law.busy_fraction * self.cap
            return self._move(self._grown() if binding else self.cap, now)
        return self._move(self._target(inflight, now), now)

    # -- steps ------------------------------------------------------------------------------

    def _gather(self, interval: Interval) -> None:
        """Merge consecutive intervals of the same batch until they span `min_iterations`
        engine iterations: a count of 2 or 3 iterations in a sample is a ±30% error from
        rounding alone (a vLLM CPU iteration takes 20-300 ms)."""
        pending = self._pending
        if pending is not None and not same_batch(pending.batch, interval.batch):
            self._flush()
            pending = None
        merged = interval if pending is None else merge(pending, interval)
        if merged.iterations >= self.law.min_iterations:
            self._pending = None
            self._learn(merged)
        else:
            self._pending = merged

    def _flush(self) -> None:
        """The batch moved or the engine idled: fit what was gathered if it is long enough
        to mean something (a quarter of `min_iterations`), else drop it."""
        pending, self._pending = self._pending, None
        if pending is not None and pending.iterations >= self.law.min_iterations / 4:
            self._learn(pending)

    def _learn(self, interval: Interval) -> None:
        """Judge the interval against the curve, then fit it. An interval the curve misses by
        more than `change_error` is held out (a transient must not bend the curve); when the
        median error of the last `change_window` intervals is that far off, the engine has
        changed: the fit starts over from the held-out intervals."""
        law = self.law
        if same_batch(interval.in_batch, self.cap):
            # the level is observed once the batch reached it (a lowered cap is reached only
            # as running requests finish)
            self._observed = True
        enough = self.fit.observations >= law.min_observations
        judged = self.fit.residual(interval) if enough else None
        if judged is None:
            self.fit.add(interval)
            return
        error, se = judged
        # where the fit extrapolates (a mix it has not seen) its own error is allowed for
        error = math.copysign(max(abs(error) - 2 * se, 0.0), error)
        self._errors.append(error)
        if abs(error) <= law.change_error:
            self.fit.add(interval)
            return
        self._suspects.append(interval)
        window = self._errors
        if len(window) == window.maxlen and abs(statistics.median(window)) > law.change_error:
            self.fit = EngineFit(law.half_life_s)  # a different engine: start over
            for held in self._suspects:
                self.fit.add(held)
            self._errors.clear()
            self._suspects.clear()
            self._settled = False
            self._rest, self._rests, self._probes_due = None, 0, 0
            self.changes += 1

    def _limit(
        self,
        now: float,
        sample: EngineSample,
        inflight: int,
        last_waiting: float | None,
        *,
        full: bool,
    ) -> int:
        law = self.law
        # a queue seen while the cap still doubles is the prefill backlog of the requests
        # just admitted, not the engine's own limit: a short ceiling, like KV's
        hold = law.limit_hold_s if full or self.slow_start else law.queue_hold_s
        self.slow_start = False
        new = self.cap - max(1, math.ceil(self.cap * law.backoff)) if full else self.cap - 1
        if sample.waiting is not None and not full:
            # the engine runs about `inflight - waiting`: cap there plus the allowance
            waiting = min(sample.waiting, last_waiting or 0.0)
            new = min(new, inflight - math.ceil(waiting) + int(law.waiting_high))
        new = self._clamp(new)
        self._ceiling = (new, now + hold)
        return self._move(new, now)

    def _target(self, inflight: int, now: float) -> int:
        """Where the curve says the cap belongs, or the next exploration level."""
        law = self.law
        est = self.efficient_batch()
        binding = inflight >= law.busy_fraction * self.cap
        self._settled = self.confident()
        if est is not None and self._settled:
            self.slow_start = False
            if est[1] > law.confident_error / 2 and binding and self._observed:
                # trusted but not yet precise: keep the batch varying a little around the
                # estimate, or the fit (fed one batch size only) could never correct it
                self._explore = -self._explore
                return max(1, round(est[0] * (1 + self._explore * law.refine_step)))
            target = round(est[0])
            if abs(target - self.cap) <= law.deadband * self.cap:
                return self.cap  # settled: noise in the estimate does not move the cap
            return target
        if not binding:
            return self.cap  # demand, not the cap, sets the batch: nothing to explore
        if not self._observed:
            return self.cap  # each level is held until the fit has an observation of it
        if self.slow_start and est is None and self.cap < law.max_cap:
            # the backlog this cap holds back is what the policy orders: grow only as far as
            # the fit needs for an estimate (a second batch size, then enough intervals),
            # not ahead of it
            low, high = self.fit.batch_span
            if high < MIN_SPAN * low:  # below if the floor allows, else above
                lower = math.floor(self.cap / MIN_SPAN)
                return lower if lower >= self.floor else math.ceil(self.cap * MIN_SPAN)
            if self.fit.observations < 2 * law.min_observations:
                return self.cap
            fixed = (self.fit.coefficients() or {}).get("alpha", 1.0)
            if fixed <= 0:  # no fixed cost to share: a smaller batch loses no throughput
                return max(self.floor, self.cap // 2)
        cautious = None if est is None else est[0] * math.exp(-law.doubt * est[1])
        resting = self._resting(est, cautious, now)
        if resting is not None:
            self.slow_start = False
            return resting
        if self.slow_start and (cautious is None or self.cap < 2 * cautious):
            if self.cap >= law.max_cap:
                return self.cap // 2  # the top, still no curve: look below instead
            return self._grown()
        self.slow_start = False
        centre = cautious if cautious is not None else self.cap * (1 + law.explore_step)
        direction = -self._explore
        self._explore = direction
        return max(self.floor, round(centre * (1 + direction * law.explore_step)))

    def _resting(
        self, est: tuple[float, float] | None, cautious: float | None, now: float
    ) -> int | None:
        """The level an exploration that cannot pay rests at, None while exploring goes on."""
        law = self.law
        if self._rest is not None:
            if now < self._rest[1]:
                return self._rest[0]
            self._rest, self._probes_due = None, 2  # probe above and below, then judge
        if est is None or cautious is None or self.fit.observations < law.explore_judged_after:
            return None  # exploring is how the fit gets an estimate worth judging
        if self._probes_due > 0:
            self._probes_due -= 1
            return None
        needed = self.fit.observations * ((est[1] / law.confident_error) ** 2 - 1)
        if needed <= law.explore_horizon:
            self._rests = 0
            return None
        rest_s = min(law.explore_rest_s * 2**self._rests, law.explore_rest_max_s)
        self._rests += 1
        self._rest = (max(self.floor, round(cautious)), now + rest_s)
        return self._rest[0]

    def _grown(self) -> int:
        factor = self.law.slow_start_factor if self.slow_start else 1 + self.law.explore_step
        return max(self.cap + 1, round(self.cap * factor))

    def _move(self, cap: int, now: float) -> int:
        if self._ceiling is not None:
            ceiling, until = self._ceiling
            if now < until:
                cap = min(cap, ceiling)
            else:
                self._ceiling = None
        new = self._clamp(cap)
        if new != self.cap:
            self.cap, self._observed = new, False
        return self.cap

    def _recall(self, memory: dict[str, Any]) -> None:
        try:
            fit = EngineFit.from_dict(memory["fit"])
        except (KeyError, TypeError, ValueError):
            return  # not a memory of this format: start cold
        fit.half_life_s = self.law.half_life_s
        self.fit = fit
        if self.confident():
            self.slow_start, self._settled = False, True
            est = self.efficient_batch()
            assert est is not None
            self.cap = self._clamp(round(est[0]))
        # an untrusted curve keeps its evidence but not its cap: where an exploring cap
        # happened to stand when the gateway stopped says nothing about the engine

    def _clamp(self, cap: int) -> int:
        return max(self.law.min_cap, min(self.law.max_cap, cap))


MIN_SPAN = 1.5
"""The fit is used only once the batches it saw span at least this factor."""


def combine_kv(values: list[float]) -> float | None:
    """KV usage of one server reporting several engines (label `engine`, data parallel):
    the fullest engine, since the first one to run out preempts. None when none reported."""
    return max(values) if values else None


PRIORITY_LEVELS_PER_OCTAVE = 4
"""vLLM priority levels per factor of two in the policy's primary key (about 19% apart)."""
PRIORITY_BOUND = 1_000_000


def priority_level(key0: float, levels_per_octave: int = PRIORITY_LEVELS_PER_OCTAVE) -> int:
    """A policy's primary key (lower first) quantised to vLLM's integer priority (lower
    first), on a log scale so keys spread over orders of magnitude (Gittins indices, costs)
    keep their order to within 2^(1/levels_per_octave).

    Monotone non-decreasing within each sign of the key: a negative key -x (SageSched's minus
    Gittins index) maps to -L·log2(x), a positive key x (a predicted length) to L·log2(x). 0
    maps to 0. Equal levels are served by arrival inside vLLM (FCFS within a level)."""
    if key0 == 0 or math.isnan(key0):
        return 0
    if math.isinf(key0):
        return PRIORITY_BOUND if key0 > 0 else -PRIORITY_BOUND
    level = levels_per_octave * math.log2(abs(key0))
    level = -level if key0 < 0 else level
    return max(-PRIORITY_BOUND, min(PRIORITY_BOUND, math.floor(level)))


__all__ = [
    "PRIORITY_LEVELS_PER_OCTAVE",
    "CapController",
    "CapLaw",
    "EngineSample",
    "combine_kv",
    "priority_level",
]
