"""The slot: the one object through which a request's relay talks to the scheduler.

`Dispatcher.slot(job)` hands the relay a `Slot` (an async context manager); the relay never
calls the dispatcher otherwise, and the dispatcher never calls the relay. Everything a slot
says crosses a process boundary as one small message per event (admit, grant, review point,
attempt outcome, finish), never one per token, so a relay in one process can hold a slot of a
scheduler in another (`PreemptWindow` is the part both sides share).

    async with dispatcher.slot(job) as slot:          # admit: QueueFull / Shed
        while True:
            grant = await slot.granted()              # QueueTimeout / Shed
            result = await attempt(grant)             # tokens: slot.tokens(n)
            if result is Attempt.COMPLETED:
                slot.ended(Attempt.COMPLETED)
                break
            slot.ended(result, backend_down=...)      # PREEMPTED / RETRY (UpstreamFailed)
    # exit: finished exactly once, whatever happened
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from gateway.scheduling.backends import Backend
    from policies import Job


class Attempt(enum.Enum):
    """How one upstream attempt of a request ended (the relay's report to its slot)."""

    COMPLETED = "completed"
    """The whole answer reached the client."""
    PREEMPTED = "preempted"
    """The scheduler took the backend slot back mid-stream (`PreemptWindow.preempted`): the
    request waits again and resumes as a continuation."""
    RETRY = "retry"
    """The backend failed before the first byte: wait again for another backend."""


@dataclass(frozen=True, slots=True)
class Grant:
    """A backend slot granted to a request: where to send it, at which vLLM priority."""

    backend: Backend
    priority: int | None
    """vLLM's integer priority for this attempt, or None when not forwarded to the backend."""


class Slot(Protocol):
    """One request's place in the scheduler, from admission to finish.

    Contract (what an implementation must guarantee, local or remote):

    - Entering `async with dispatcher.slot(job) as slot` admits the job or raises
      `QueueFull` / `Shed` (then nothing is held and nothing needs finishing). Leaving it,
      whatever the way (return, exception, cancellation when the client leaves), finishes the
      job exactly once: out of the queue if it waits, its backend slot released if it holds
      one. Nothing else finishes a slot; `ended` never does except for COMPLETED.
    - `granted()` waits for the next backend slot: the first one, and again after each
      PREEMPTED or RETRY. It raises `QueueTimeout` after the class's (or the gateway's) queue
      timeout and `Shed` when a more urgent arrival evicted the job from a full queue.
      Cancelling it (the client left) is safe: the exit withdraws the job.
    - `tokens(n)`: `n` more output tokens reached the client. It is called once per upstream
      read (the tokens of the events read together), so it must be cheap. The scheduler needs
      to hear of them only when the request's total (`job.generated`, all attempts) reaches
      `review_at` (None: not before the attempt ends); a remote slot counts locally and sends
      one message there, plus the remainder with `ended`. The local slot forwards every call
      (`Scheduler.progress`, one call in the same process), so running keys stay exact
      between review points.
    - `preemptible()`: a new `PreemptWindow` for the current attempt, the only time the
      scheduler may preempt it (the relay opens it around reading a stream; only a stream of a
      continuable call is ever preempted). Preemption cancels the task inside the window, so a
      stream stalled in vLLM is preempted as well; the window swallows that cancellation and
      sets `preempted`, while a client's own cancellation still propagates. A preemption
      decided inside the window (by the relay's own `tokens`) sets `requested`, which the
      relay checks after each chunk. After a preempted window the relay closes the upstream
      response itself and reports PREEMPTED; a window that saw the answer's end completes.
    - `ended(attempt, backend_down=...)` reports how an attempt ended, once per grant:
      COMPLETED (the job is finished now), PREEMPTED (the job waits again, as a continuation),
      RETRY (the backend is excluded for this job, marked down if `backend_down`, and the job
      waits again; raises `UpstreamFailed` when retries are used up or no other backend serves
      the model).
    """

    job: Job
    review_at: int | None
    """The `job.generated` count at which the scheduler next wants to hear (None: no review
    point before the attempt ends). Set at each grant and each review point."""

    async def __aenter__(self) -> Slot: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...

    async def granted(self) -> Grant: ...

    def tokens(self, n: int) -> None: ...

    def preemptible(self) -> PreemptWindow: ...

    def ended(self, attempt: Attempt, *, backend_down: bool = False) -> None: ...


class PreemptWindow:
    """A with-block of the relay's task that the scheduler may preempt (`Slot.preemptible`).

    `preempt()` from other code on the loop cancels the task running the block (as
    `asyncio.timeout` does), so the block stops at whatever it awaits: a read from a backend
    that sends nothing ends as surely as one that streams; on exit that cancellation is
    swallowed and `preempted` set, while a second cancellation (the client left meanwhile) is
    not. `preempt()` from the block itself (its own token report reached a review point and
    made it the victim) only sets `requested`: the block checks it after each relayed chunk
    and stops reading. Bytes already handed to the client's transport stay sent: the relay
    counts a chunk's tokens and writes it in one step, and a write suspends only after its
    bytes are in the transport. A block that saw the answer's end completes regardless.
    """

    __slots__ = ("_cancelled", "_cancelling", "_task", "preempted", "requested")

    def __init__(self) -> None:
        self._task: asyncio.Task[object] | None = None
        self._cancelling = 0
        self._cancelled = False
        self.requested = False
        """`preempt()` took effect: the block is being stopped."""
        self.preempted = False
        """The block ended because of a preemption (read after the block)."""

    @property
    def open(self) -> bool:
        """Inside the block and not yet asked to stop: preemptible now."""
        return self._task is not None and not self.requested

    def __enter__(self) -> PreemptWindow:
        task = asyncio.current_task()
        assert task is not None, "a preemptible window runs in a task"
        self._task = task
        self._cancelling = task.cancelling()
        return self

    def preempt(self) -> bool:
        """Stop the block. False when the window is not open."""
        if not self.open:
            return False
        assert self._task is not None
        self.requested = True
        if asyncio.current_task() is not self._task:
            self._cancelled = True
            self._task.cancel(msg="preempted by the scheduler")
        return True

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        task, self._task = self._task, None
        if not self.requested or task is None:
            return False
        if not self._cancelled:  # asked from inside: the block stopped at its own check
            self.preempted = exc_type is None
            return False
        # the cancellation is delivered inside the block: the task can only have been
        # suspended there when another task called `preempt()`
        if task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
            self.preempted = True
            return True
        return False
