"""The in-flight cap that tunes itself, and vLLM priority levels: pure control laws.

Why a cap: vLLM admits every request into its own FCFS queue, so a gateway policy orders
anything only while the backlog waits in the gateway. Too small a cap throttles the engine;
too large a cap leaves the backlog in vLLM's queue. The right cap is the engine's *efficient
batch*: the most requests it runs at once before extra ones stop adding throughput, stop
fitting in KV, or start waiting inside it.

`CapController` finds it from what the engine itself reports (vLLM's `/metrics` in the
gateway; the engine model's state in the simulator), one `observe` per sample:

1. **Limits.** vLLM's waiting queue above `waiting_high` in two samples in a row (one
   prompt waiting a step for the token budget is no full batch): the engine runs only about
   `inflight - waiting` (its `max_num_seqs`, or what its KV admits), so the cap
   drops to that plus `waiting_high`. KV usage above `kv_high`: the engine is about to
   preempt; the cap shrinks by `backoff` (multiplicative decrease).
2. **No information.** The gateway does not fill the cap (fewer than `busy_fraction` × cap in
   flight): demand, not the cap, sets the batch; the cap holds. More than the cap in flight
   (just lowered): the new level is not in force yet; the measurement waits.
3. **Hill climb on throughput.** Otherwise each cap level is held for `settle` samples and
   until `turnover` × cap requests have finished (the batch's mix of fresh and old requests
   has settled), then its generation-token rate is measured over `dwell` samples, extended
   (up to 4×) until the window spans `min_iterations` engine iterations. Between two levels
   the elasticity e = Δln(rate) / Δln(cap) says where the efficient batch lies: e ≥
   `min_elasticity` (a larger batch still buys throughput in proportion) → go up; below →
   go down. A move that did not pay is undone (back to the level before) and halves the
   step. Levels grow by `slow_start_factor` at first (slow start: `settle`, then one sample
   per level, every `slow_start_interval_s`: under overload every second at a small cap
   builds a backlog that never drains) and by `step` after the first reversal or limit, the
   step doubling from the fourth move the same way on (up to `max_step`), so the cap settles
   within about ±`step` of the point where the elasticity drops below `min_elasticity`.
   Without a throughput series (unknown) the cap grows by `step` while the engine shows no
   queue and KV room (plain AIMD).

A series the engine does not report is *unknown* (`None`), never 0: an unknown queue or KV
usage is no limit, an unknown throughput disables the climb, and with nothing known at all
the cap holds where it was configured. A counter that goes backwards
(engine restart) restarts the measurement.

Everything here is pure: time is a number passed in (wall seconds in the gateway, virtual
seconds in the simulator), so both run the same controller.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineSample:
    """One reading of an engine's own metrics; None = the series is unknown."""

    waiting: float | None = None
    """Requests waiting inside the engine (vLLM `num_requests_waiting`)."""
    kv_usage: float | None = None
    """KV-cache usage in [0, 1] (vLLM `kv_cache_usage_perc`)."""
    generation_tokens: float | None = None
    """Cumulative output tokens generated (vLLM `generation_tokens_total`)."""


@dataclass(frozen=True, slots=True)
class CapLaw:
    """Parameters of `CapController` (caps in requests, times in the caller's seconds)."""

    interval_s: float = 1.0
    """Seconds between samples (the caller samples every `CapController.interval_s`)."""
    slow_start_interval_s: float = 0.25
    """Seconds between samples during slow start."""
    min_cap: int = 1
    max_cap: int = 1024
    kv_high: float = 0.95
    """KV usage above which the cap shrinks (vLLM preempts when KV runs out)."""
    waiting_high: float = 2.0
    """Engine waiting requests above which the cap shrinks (a few may wait for one step)."""
    backoff: float = 0.125
    """Multiplicative decrease on a limit."""
    step: float = 0.125
    """Relative move of the hill climb after slow start."""
    max_step: float = 0.5
    """Largest relative move of the hill climb (the step doubles up to it on a long run of
    moves the same way). ×2 per level, once tried, crossed a knee at 28 from 21 to 84, and
    the over-full engine took 12 s to drain back."""
    slow_start_factor: float = 2.0
    """Growth per sample during slow start (from a cold start, before the first limit)."""
    min_elasticity: float = 0.5
    """Elasticity of throughput to the cap below which the batch counts as saturated."""
    settle: int = 1
    """Samples skipped after a move (the new requests' prefill)."""
    dwell: int = 2
    """Samples a level is measured over."""
    min_iterations: int = 8
    """Engine iterations (generated tokens / requests in flight) a level's window must span
    before it is judged: a 0.25 s slow-start sample holds only a few slow iterations, and a
    rate over so few is noise that can send slow start past the batch."""
    turnover: float = 0.5
    """After slow start, a level is measured only once this share of its cap has finished
    since it came into force (when the caller counts finished requests). Until then the batch
    still holds the old level's mix of requests: after a move up, fresh ones with short
    contexts run fast; after a move down, old ones with long contexts run slow. Judged
    earlier, that bias alone (one level up ≈ +0.4 elasticity) walked the emulator's cap
    from a knee at 24 up to 48-61."""
    busy_fraction: float = 0.9
    """The cap binds while at least this share of it is in flight."""

    def __post_init__(self) -> None:
        if self.slow_start_factor <= 1:
            raise ValueError("need slow_start_factor > 1")
        if not 1 <= self.min_cap <= self.max_cap:
            raise ValueError("need 1 <= min_cap <= max_cap")
        if self.interval_s <= 0 or self.slow_start_interval_s <= 0:
            raise ValueError("need interval_s > 0")
        if self.min_iterations < 0:
            raise ValueError("need min_iterations >= 0")
        if not 0 < self.step <= self.max_step:
            raise ValueError("need 0 < step <= max_step")
        if self.dwell < 1 or self.settle < 0 or not 0 < self.backoff < 1:
            raise ValueError("need dwell >= 1, settle >= 0, 0 < backoff < 1")


class CapController:
    """One engine's cap. Call `observe` once per sample, in time order; read `cap`."""

    def __init__(self, law: CapLaw, cap: int) -> None:
        self.law = law
        self.cap = self._clamp(cap)
        self.slow_start = True
        self._streak = 0
        """Consecutive climb moves up (> 0) or down (< 0)."""
        self._step = law.step
        self._waiting: float | None = None
        """The engine queue at the previous sample."""
        self.rate: float | None = None
        """Throughput of the last level measured (tokens per second), if any."""
        self._prev: tuple[int, float] | None = None
        """(cap, rate) of the last level measured."""
        self._last: tuple[float, float] | None = None
        """(time, generation counter) of the previous sample."""
        self._skip = law.settle
        self._finished: int | None = None
        """The caller's count of finished requests at the latest sample."""
        self._mark: int | None = None
        """That count when the current level came into force."""
        self._tokens = 0.0
        self._seconds = 0.0
        self._samples = 0

    @property
    def interval_s(self) -> float:
        """Seconds until the caller should sample again."""
        return self.law.slow_start_interval_s if self.slow_start else self.law.interval_s

    def observe(
        self, now: float, sample: EngineSample, inflight: int, finished: int | None = None
    ) -> int:
        """One sample at time `now` with `inflight` requests of the gateway on this engine;
        `finished`: the caller's running count of requests that left this engine (None:
        not counted, a level is judged after `settle` samples alone). Returns the (possibly
        new) cap."""
        law = self.law
        self._finished = finished
        if self._mark is None:
            self._mark = finished  # the configured level counts from the first sample
        if sample == EngineSample():
            return self.cap  # nothing known (no metrics endpoint): keep the configured cap
        delta = self._counter_delta(now, sample.generation_tokens)
        # a queue counts once it is seen twice in a row: a prompt waiting one step for the
        # token budget is no sign of a full batch
        last_waiting, self._waiting = self._waiting, sample.waiting
        queued = (
            sample.waiting is not None
            and last_waiting is not None
            and min(sample.waiting, last_waiting) > law.waiting_high
        )
        full = sample.kv_usage is not None and sample.kv_usage > law.kv_high
        if queued or full:
            self.slow_start = False
            self._prev = None
            self._streak, self._step = 0, self.law.step
            new = self.cap - max(1, math.ceil(self.cap * law.backoff)) if full else self.cap - 1
            if queued:
                # the engine runs about `inflight - waiting`: cap there plus the allowance
                assert sample.waiting is not None
                waiting = min(sample.waiting, last_waiting or 0.0)
                new = min(new, inflight - math.ceil(waiting) + int(law.waiting_high))
            return self._move(new)
        if not law.busy_fraction * self.cap <= inflight <= self.cap:
            # below: demand sets the batch; above: a lower cap is not in force until enough
            # requests finished, and measuring now would credit it with the old batch's rate
            self._restart_level()
            return self.cap
        if self._skip > 0:
            self._skip -= 1
            return self.cap
        if not self.slow_start and not self._turned_over():
            return self.cap  # the batch still holds the previous level's mix
        if delta is None:
            if sample.generation_tokens is None:  # no throughput series: plain AIMD growth
                return self._move(self._up(self.cap))
            self._restart_level()
            return self.cap
        self._tokens += delta[0]
        self._seconds += delta[1]
        self._samples += 1
        needed = 1 if self.slow_start else law.dwell
        iterations = self._tokens / max(1, inflight)
        if self._samples < needed or (
            iterations < law.min_iterations and self._samples < 4 * needed
        ):
            return self.cap  # too short a window: keep measuring (at most 4x as long)
        return self._judge(self._tokens / self._seconds if self._seconds > 0 else 0.0)

    # -- steps ------------------------------------------------------------------------------

    def _judge(self, rate: float) -> int:
        """A level was measured: climb up or down."""
        self.rate = rate
        prev, self._prev = self._prev, (self.cap, rate)
        if prev is None or prev[0] == self.cap:
            return self._move(self._up(self.cap))
        up = _elasticity(prev, (self.cap, rate)) >= self.law.min_elasticity
        if self.slow_start:
            if up:
                return self._move(self._up(self.cap))
            self.slow_start = False
            self._streak, self._step = 0, self.law.step
        if (self.cap > prev[0]) != up:
            # the last move did not pay: undo it (the level before was measured better),
            # a reversal, so the step halves. A ×1.5 overshoot past the batch comes back in
            # one level instead of three.
            self._factor(1 if up else -1)
            return self._move(prev[0])
        return self._move(self._up(self.cap) if up else self._down(self.cap))

    def _factor(self, direction: int) -> float:
        """Step factor of a climb move. From the fourth move in the same direction on, the
        step doubles with every further one (up to `max_step`), so a far-off batch is reached in a
        few levels; a reversal halves it (down to `step`), so the climb closes in on the
        batch instead of circling it."""
        if self._streak * direction > 0:
            self._streak += direction
            if abs(self._streak) >= 4:
                self._step = min(self.law.max_step, self._step * 2.0)
        else:
            if self._streak != 0:
                self._step = max(self.law.step, self._step / 2.0)
            self._streak = direction
        return 1.0 + self._step

    def _up(self, cap: int) -> int:
        factor = self.law.slow_start_factor if self.slow_start else self._factor(1)
        return max(cap + 1, round(cap * factor))

    def _down(self, cap: int) -> int:
        return min(cap - 1, round(cap / self._factor(-1)))

    def _move(self, cap: int) -> int:
        new = self._clamp(cap)
        if new != self.cap:
            self.cap = new
            self._restart_level()
        return self.cap

    def _turned_over(self) -> bool:
        if self._finished is None or self._mark is None:
            return True
        return self._finished - self._mark >= self.law.turnover * self.cap

    def _restart_level(self) -> None:
        self._mark = self._finished
        self._skip = self.law.settle
        self._tokens = self._seconds = 0.0
        self._samples = 0

    def _clamp(self, cap: int) -> int:
        return max(self.law.min_cap, min(self.law.max_cap, cap))

    def _counter_delta(self, now: float, counter: float | None) -> tuple[float, float] | None:
        """(tokens, seconds) since the previous sample, or None when unknown or reset."""
        last = self._last
        self._last = None if counter is None else (now, counter)
        if counter is None or last is None or counter < last[1] or now <= last[0]:
            return None
        return counter - last[1], now - last[0]


def _elasticity(a: tuple[int, float], b: tuple[int, float]) -> float:
    """Δln(rate) / Δln(cap) between two measured levels (caps differ)."""
    (cap_a, rate_a), (cap_b, rate_b) = a, b
    if rate_a <= 0 or rate_b <= 0:
        # no tokens at one level: a larger cap that produced some counts as paying
        return 1.0 if (rate_b > rate_a) == (cap_b > cap_a) else 0.0
    return math.log(rate_b / rate_a) / math.log(cap_b / cap_a)


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
