"""Engine shares: how much of a backend's running batch a band may hold while a more urgent
band is active.

A queue order decides who starts next, not how many of a band run at once. Once a batch job
holds a slot it shares every engine iteration with the interactive ones, so each of their
tokens slows down however well the queue is ordered. `EngineShares` bounds that, per backend:

- **Share.** A band with an engine share s may hold at most max(1, floor(s · cap)) of a
  backend's slots while a more urgent band is *active*: it has requests waiting, or one of its
  requests arrived within the last `window_s` seconds. Where the backend reports its KV size,
  the band may also hold at most s of it: a job starts only if the band's running context
  (prompt and generated tokens) plus the job's prompt stays within s · KV (its first job always
  may), so a few long batch prompts cannot fill the KV the urgent band needs.
- **TPOT objective.** A band with a time-per-output-token objective bounds the whole batch of
  a backend while it is active: a less urgent band starts a job there only while the running
  batch is below B* = max{B ≤ cap : t(B) ≤ objective}, where t(B) is the engine's predicted
  time per iteration (one output token of every running request) at a batch of B (`tpot_batch`).
  This is the share derived from the objective: the less urgent bands may hold
  B* minus what the urgent band runs. Where the engine's curve is unknown the rule waits for it.
- **Work-conserving.** With no more urgent band active, a band takes any free slot: it is lent
  the share (`Start.LENT`). The loan is taken back by not granting the band more, never by
  preemption (a policy's own preemption rules are separate).

Pure: the engine's curve is a function handed in, time is a number; the gateway dispatcher and
the simulator ask the same object (through `policies.catalog.bands.Bands.start_rule`).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from policies.job import Job


class Start(enum.Enum):
    """May a job start on a backend now, and on what terms."""

    FREE = "free"
    """Within its band's share (or no rule applies)."""
    LENT = "lent"
    """Beyond its band's share, lent because no more urgent band is active."""
    HELD = "held"
    """Not now: its band is at its share, or the batch at an urgent band's TPOT bound."""


@dataclass(frozen=True, slots=True)
class EngineView:
    """One backend as the start rule sees it."""

    running: Sequence[Job]
    """The jobs running there now (of every band)."""
    cap: int
    """Its in-flight cap."""
    iteration_s: Callable[[int], float] | None = None
    """Predicted seconds of one engine iteration at a running batch of B (each running request
    gets one output token per iteration: the TPOT at that batch); None while unknown."""
    kv_tokens: float | None = None
    """Its KV cache's size in tokens; None while unknown."""


def context_tokens(jobs: Sequence[Job], band: int) -> int:
    """The KV the running `jobs` of `band` hold: their prompt and generated tokens."""
    return sum(j.prompt_tokens + j.generated for j in jobs if j.priority == band)


def share_slots(share: float, cap: int) -> int:
    """The slots a band with engine share `share` may hold on a backend of cap `cap`."""
    return max(1, math.floor(share * cap + 1e-9))


def tpot_batch(iteration_s: Callable[[int], float], objective_s: float, cap: int) -> int:
    """The largest batch B <= `cap` whose predicted time per output token is within
    `objective_s` (at least 1: the urgent band itself is never held). `iteration_s` must not
    fall as the batch grows (a batch never makes an iteration shorter)."""
    if cap <= 1 or iteration_s(2) > objective_s:
        return 1
    low, high = 2, cap  # iteration_s(low) is within the objective
    while low < high:
        mid = (low + high + 1) // 2
        if iteration_s(mid) <= objective_s:
            low = mid
        else:
            high = mid - 1
    return low


@dataclass(slots=True)
class EngineShares:
    """The rule for one run: each band's share and TPOT objective, and when each band's
    requests last arrived."""

    shares: Mapping[int, float]
    """Band → engine share (fraction of a backend's cap it may hold while a more urgent band
    is active). Bands absent: no share of their own."""
    tpot_objectives: Mapping[int, float]
    """Band → time per output token (seconds) its requests are promised."""
    window_s: float = 10.0
    """A band is active while it has requests waiting or for this long after an arrival."""
    _arrived: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for band, share in self.shares.items():
            if not 0.0 < share <= 1.0:
                raise ValueError(f"engine share of band {band} must be in (0, 1], got {share}")
        for band, slo in self.tpot_objectives.items():
            if slo <= 0:
                raise ValueError(f"TPOT objective of band {band} must be > 0, got {slo}")
        if self.window_s < 0:
            raise ValueError("the activity window must be >= 0")

    @property
    def enabled(self) -> bool:
        return bool(self.shares or self.tpot_objectives)

    def arrived(self, band: int, now: float) -> None:
        """A request of `band` arrived at `now`."""
        self._arrived[band] = max(now, self._arrived.get(band, now))

    def active(self, band: int, now: float, waiting: Callable[[int], int]) -> bool:
        """Has `band` requests waiting, or one that arrived within the window?"""
        last = self._arrived.get(band)
        return waiting(band) > 0 or (last is not None and now - last <= self.window_s)

    def start(
        self,
        band: int,
        engine: EngineView,
        now: float,
        waiting: Callable[[int], int],
        prompt_tokens: int = 0,
    ) -> Start:
        """May a job of `band` with `prompt_tokens` start on `engine` now? `waiting(b)`: jobs
        of band b waiting."""
        if not self.enabled:
            return Start.FREE
        urgent = self._urgent(band, now, waiting)
        share = self.shares.get(band)
        beyond = share is not None and self._beyond(share, band, engine, prompt_tokens)
        if not urgent:
            return Start.LENT if beyond else Start.FREE
        if beyond:
            return Start.HELD
        if self.batch_bound(urgent, engine) <= len(engine.running):
            return Start.HELD
        return Start.FREE

    @staticmethod
    def _beyond(share: float, band: int, engine: EngineView, prompt_tokens: int) -> bool:
        """Would one more job of `band` take it beyond its share of the slots or the KV?"""
        mine = sum(1 for j in engine.running if j.priority == band)
        if mine >= share_slots(share, engine.cap):
            return True
        if engine.kv_tokens is None or mine == 0:
            return False
        return context_tokens(engine.running, band) + prompt_tokens > share * engine.kv_tokens

    def batch_bound(self, urgent: Sequence[int], engine: EngineView) -> int:
        """The largest batch the TPOT objectives of the `urgent` bands allow on `engine` (its
        cap when none of them has one or the engine's curve is unknown)."""
        objectives = [self.tpot_objectives[b] for b in urgent if b in self.tpot_objectives]
        if not objectives or engine.iteration_s is None:
            return engine.cap
        return tpot_batch(engine.iteration_s, min(objectives), engine.cap)

    def limits(
        self, engine: EngineView, now: float, waiting: Callable[[int], int]
    ) -> dict[int, int]:
        """Band → the slots it may hold on `engine` now (its cap where nothing bounds it): for
        the metrics. Covers the bands with a share and those below a TPOT objective."""
        out = {}
        most_urgent_objective = min(self.tpot_objectives, default=math.inf)
        seen = set(self._arrived) | {j.priority for j in engine.running}
        below = {b for b in seen if b > most_urgent_objective}
        for band in sorted(set(self.shares) | below):
            urgent = self._urgent(band, now, waiting)
            if not urgent:
                out[band] = engine.cap
                continue
            share = self.shares.get(band)
            own = engine.cap if share is None else share_slots(share, engine.cap)
            others = sum(1 for j in engine.running if j.priority != band)
            out[band] = max(0, min(own, self.batch_bound(urgent, engine) - others))
        return out

    def _urgent(self, band: int, now: float, waiting: Callable[[int], int]) -> list[int]:
        """The bands more urgent than `band` that are active now."""
        return [b for b in self._arrived if b < band and self.active(b, now, waiting)]
