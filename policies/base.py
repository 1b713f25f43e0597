"""The policy contract: what every scheduling policy answers, and nothing more.

Engines (the gateway dispatcher, the simulator) only call these methods; they never ask which
policy they hold. A policy is a dataclass of typed parameters. Policies with state across jobs
(fair-share counters) keep it in fields that `fresh()` rebuilds, so the configured object is a
template and every run (a gateway process, one simulation) works on its own copy.

Time is a number passed in (seconds of the engine's clock); sizes are tokens. Nothing here
reads a clock or does I/O.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar, Self

from policies.capacity import priority_level
from policies.cost import LinearProfile
from policies.job import Job
from policies.queue import Key as Key  # the policies name it from here
from policies.queue import PolicyQueue, WaitingQueue
from policies.shares import EngineView, Start


def param(default: Any, help: str) -> Any:
    """A policy parameter with its help text (shown by `sagesched policies`)."""
    return dataclasses.field(default=default, metadata={"help": help})


def engine_param() -> Any:
    """A fact about the engine the policy runs on (its cost profile), set by the engine through
    `on_engine`, not by the user: kept by `fresh()`, left out of labels and the catalog."""
    return dataclasses.field(default=None, repr=False, compare=False, metadata={"engine": True})


def state(factory: Any) -> Any:
    """Per-run mutable state: excluded from parameters, rebuilt by `fresh()`."""
    return dataclasses.field(default_factory=factory, init=False, repr=False, compare=False)


class Parametrised:
    """Parameters as dataclass fields, per-run state rebuilt by `fresh()`: what policies and
    routers (`policies.routing`) share. Subclasses are dataclasses with a `name`."""

    name: ClassVar[str] = ""

    def fresh(self) -> Self:
        """A copy with the same parameters and empty per-run state."""
        return type(self)(**self.params())

    def params(self) -> dict[str, Any]:
        """The parameters (init fields) as a plain dict."""
        fields = dataclasses.fields(self)  # type: ignore[arg-type]
        return {f.name: getattr(self, f.name) for f in fields if f.init}

    def label(self) -> str:
        """`name` plus any non-default parameters, e.g. `sagesched:cost=tokens`."""
        changed = [
            f"{f.name}={getattr(self, f.name)}"
            for f in dataclasses.fields(self)  # type: ignore[arg-type]
            if f.init and not f.metadata.get("engine") and getattr(self, f.name) != f.default
        ]
        return self.name + (":" + ",".join(changed) if changed else "")


@dataclasses.dataclass(eq=False)
class Policy(Parametrised, abc.ABC):
    """Base class of every policy. Subclasses are dataclasses registered by name.

    Class attributes answer the engine's questions:
    - `name`, `description`: stable identifier (CLI, metric label, report) and one line.
    - `needs_prediction`: the job must carry `dist` (a predicted length distribution).
    - `needs_oracle`: the job must carry `true_output_tokens` (simulation and studies only).
    - `revalidate_on_pop`: the key may *rise* while a job waits (shared counters move); the
      stored key is a lower bound and the queue recomputes the head before handing it out.
    - `holds_starts`: `start_rule` may hold a head job off a backend (engine shares).
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    needs_prediction: ClassVar[bool] = False
    needs_oracle: ClassVar[bool] = False
    revalidate_on_pop: ClassVar[bool] = False
    holds_starts: ClassVar[bool] = False
    """Does `start_rule` ever hold a job (so the engine must describe each backend to it)?"""

    preemptive: bool = dataclasses.field(default=False, init=False)
    """May a waiting job displace a running one? Subclasses may make it a parameter."""

    # -- ordering -----------------------------------------------------------------------

    @abc.abstractmethod
    def key(self, job: Job, now: float) -> Key:
        """Sort key of `job` at time `now`; lower is served first.

        Called when the job is queued and whenever an engine compares a running job (victim
        search, forwarded rank), then at the job's current `generated`: running keys are
        computed when used, never stored. Must be deterministic and cheap (tens of µs).
        """

    def next_review(self, job: Job) -> int | None:
        """Generated-token count at which a running `job`'s key may turn against it, or None.

        Engines count streamed tokens and look for a preemption victim again when
        `job.generated` reaches this value (on arrivals they look anyway).
        """
        return None

    def review_at(self, job: Job) -> float | None:
        """Engine time at which a *waiting* job's key must be recomputed, or None if never."""
        return None

    def can_be_preempted(self, job: Job) -> bool:
        """May this running job be displaced now? Only asked when `preemptive` is true."""
        return self.preemptive

    def preemption_pays(
        self, waiting: Job, victim: Job, running: Sequence[Job], n_waiting: int
    ) -> bool:
        """Asked once the keys say `waiting` should displace the running `victim` (`running`:
        every job in the engine, the victim included; `n_waiting` queued, `waiting` included):
        is the expected saving worth the preemption's cost? Default: yes, keys decide."""
        return True

    def engine_priority(self, key: Key) -> int:
        """vLLM's integer priority (lower first) for a job dispatched under `key`: the primary
        component quantised on a log scale (`policies.capacity.priority_level`). A policy whose
        primary component is not a magnitude (the bands of `policies.catalog.bands`) says how
        its keys map instead."""
        return priority_level(key[0])

    def start_rule(self, job: Job, engine: EngineView, now: float) -> Start:
        """May `job` (the queue's head) start on this backend now? A policy that bounds how
        much of an engine a group of jobs holds (the engine shares of `bands`,
        `policies.shares`) says no with `Start.HELD`; the engine then offers the slot to the
        head of another band, or leaves it free. Default: always."""
        return Start.FREE

    def make_queue(self) -> WaitingQueue:
        """The structure that holds this policy's waiting jobs for one run (the `Scheduler`
        asks once, after `fresh()`). Default: one `PolicyQueue` ordered by `key`; a composite
        policy returns its own (bands of tenant flows, `policies.bands.BandQueue`)."""
        return PolicyQueue(self)

    def on_engine(self, cost: LinearProfile) -> Self:
        """This policy on an engine whose per-request cost `cost` describes (the simulator
        passes its latency profile's, the gateway its configured one). Default: unchanged."""
        return self

    # -- lifecycle hooks (no-ops unless a policy keeps state) ---------------------------

    def on_admit(self, job: Job, now: float) -> None:
        """The job entered the system (before its first push into the queue)."""

    def on_start(self, job: Job, now: float) -> None:
        """The job was handed to a backend (also after a requeue)."""

    def on_progress(self, job: Job, new_tokens: int, now: float) -> None:
        """`new_tokens` more output tokens were generated; `job.generated` already counts them."""

    def on_finish(self, job: Job, now: float) -> None:
        """The job left the system for good (completed, failed, dropped or cancelled)."""

    # -- runs and parameters ------------------------------------------------------------
