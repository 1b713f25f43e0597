"""`Scheduler`: the one place that drives a policy through a job's life.

Both the gateway dispatcher (wall clock) and the simulator (virtual clock) own one
`Scheduler`; it holds the run's copy of the policy, the waiting queue and the running set,
and calls the policy hooks in a fixed order:

    admit → on_admit, push          dispatch → pop, on_start
    progress → on_progress, review  requeue → push again (after preemption or retry)
    finish / cancel → on_finish

so simulated and live runs make the same decisions for the same inputs.

A running job's key is never stored: every decision that compares running jobs (the
preemption victim, the forwarded rank) computes it at the job's current attained service
(`running_key`). A key stored at the last review point goes stale as tokens stream (a Gittins
index rises between support points, a predicted remaining length shrinks), and a stale key
lets a waiting job preempt a running one that is in truth better. The review points still
matter: they tell the engine when the running order may have turned against a running job,
so it should look for a victim again (`progress` returns True).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Set as AbstractSet

from policies.base import Key, Policy
from policies.cost import LinearProfile
from policies.job import Job
from policies.queue import PolicyQueue, WaitingQueue
from policies.shares import EngineView, Start


class Scheduler:
    """Queue plus running set for one run. Not thread-safe: one event loop or one simulation."""

    __slots__ = ("_review_at", "policy", "queue", "running")

    def __init__(self, policy: Policy, cost: LinearProfile | None = None) -> None:
        """`cost`: what a request costs the engine behind this scheduler, when known (the
        simulator's latency profile; the gateway's configured profile)."""
        self.policy = (policy if cost is None else policy.on_engine(cost)).fresh()
        self.queue: WaitingQueue = self.policy.make_queue()
        self.running: dict[int, Job] = {}
        self._review_at: dict[int, int | None] = {}  # running id -> next review (tokens)

    def check(self, job: Job) -> None:
        """Raise ValueError if the policy cannot order `job` (missing prediction/oracle)."""
        if self.policy.needs_prediction and job.dist is None:
            raise ValueError(f"policy {self.policy.name} needs a predicted length for job {job.id}")
        if self.policy.needs_oracle and job.true_output_tokens is None:
            raise ValueError(f"policy {self.policy.name} needs the true length of job {job.id}")

    def admit(self, job: Job, now: float) -> Key:
        """A new job arrives: it waits in the queue. Returns its key."""
        self.check(job)
        self.policy.on_admit(job, now)
        return self.queue.push(job, now)

    def dispatch(self, now: float, held: AbstractSet[int] = frozenset()) -> Job | None:
        """A backend slot is free: hand out the best waiting job (None if none waits), passing
        over the bands in `held` (`peek`)."""
        job = self.queue.pop(now, held)
        if job is not None:
            self._start(job, now)
        return job

    def peek(self, now: float, held: AbstractSet[int] = frozenset()) -> Job | None:
        """The job `dispatch(now, held)` would hand out. `held`: bands whose head the start
        rule held on every backend with room (only a banded queue has them)."""
        return self.queue.peek(now, held)

    def start_rule(self, job: Job, engine: EngineView, now: float) -> Start:
        """May `job` start on the backend `engine` describes now (`Policy.start_rule`)?"""
        return self.policy.start_rule(job, engine, now)

    def dispatch_for(
        self, now: float, cached_tokens: Callable[[Job], int], candidates: int = 8
    ) -> Job | None:
        """A slot freed on one backend b: hand out the waiting job that is best *there*.

        `cached_tokens(job)`: the prompt tokens expected cached on b (a router's prefix
        index). Among the `candidates` best waiting jobs by the policy's key, the one whose
        key is lowest with its prefix on b discounted (`Job.cached_tokens`, which the `time`
        cost reads) wins; ties keep the policy's order, so a key that ignores the cache
        (`fcfs`, `cost=kv`) hands out exactly what `dispatch` would. The winner keeps its
        `cached_tokens`; the others wait with theirs unchanged. Rule: docs/policies.md "Who
        goes where a slot frees". Meant for a slot that freed alone (several free slots: the
        best job and a router). Only the policy's own `PolicyQueue` is searched this way; a
        composite queue (`bands`) dispatches its head. None if nothing waits.
        """
        if candidates <= 1 or not isinstance(self.queue, PolicyQueue):
            job = self.dispatch(now)
            if job is not None:
                job.cached_tokens = cached_tokens(job)
            return job
        heads: list[Job] = []
        while len(heads) < candidates and (head := self.queue.pop(now)) is not None:
            heads.append(head)
        if not heads:
            return None
        was = [j.cached_tokens for j in heads]
        here = [cached_tokens(j) for j in heads]
        best = min(range(len(heads)), key=lambda i: (self._key_with(heads[i], here[i], now), i))
        for i, job in enumerate(heads):
            if i != best:
                job.cached_tokens = was[i]
                self.queue.push(job, now)
        chosen = heads[best]
        chosen.cached_tokens = here[best]
        self._start(chosen, now)
        return chosen

    def progress(self, job: Job, new_tokens: int, now: float) -> bool:
        """A running job generated `new_tokens` more tokens. True if it reached a review
        point: its key may have risen, so the engine should look for a preemption victim."""
        job.generated += new_tokens
        self.policy.on_progress(job, new_tokens, now)
        review_at = self._review_at.get(job.id)
        if review_at is None or job.generated < review_at:
            return False
        self._review_at[job.id] = self.policy.next_review(job)
        return True

    def review_at(self, job: Job) -> int | None:
        """The generated-token count of a running job's next review (None: none, or not
        running)."""
        return self._review_at.get(job.id)

    def requeue(self, job: Job, now: float, *, preempted: bool) -> Key:
        """A running job goes back to waiting (preempted, or its backend failed)."""
        self._stop(job)
        if preempted:
            job.preemptions += 1
        return self.queue.push(job, now)

    def finish(self, job: Job, now: float) -> None:
        """The job left the system (done, failed or cancelled), wherever it was."""
        if job.id in self.running:
            self._stop(job)
        else:
            self.queue.remove(job)
        self.policy.on_finish(job, now)

    def running_key(self, job: Job, now: float) -> Key:
        """A running job's key at its current attained service (`job.generated`) and `now`.

        Computed on every call, never cached: the key may depend on the time and on shared
        policy state as well as on the tokens generated. One call is one `policy.key` (a
        Gittins index over tens of support points: 10-20 µs), so a decision over dozens of
        running jobs costs well under a millisecond.
        """
        if job.id not in self.running:
            raise KeyError(f"job {job.id} is not running")
        return self.policy.key(job, now)

    def engine_priority(self, job: Job, now: float) -> int:
        """The integer priority to send the engine with a running job (vLLM's, lower first):
        its key at `now`, as the policy maps keys to priorities (`Policy.engine_priority`)."""
        return self.policy.engine_priority(self.running_key(job, now))

    def preemption_victim(self, now: float, margin: float = 0.0) -> Job | None:
        """The running job the best waiting one should displace, or None.

        Only preemptive policies preempt, and only jobs the policy lets go (`can_be_preempted`).
        The waiting job must beat the worst running key, computed at `now` and the job's
        current attained service (one `policy.key` per candidate); with `margin` > 0 its key
        must be lower by that fraction of the victim's in the first component where the two
        differ (hysteresis against flapping; a composite key's leading parts, such as a band,
        are often equal); and the policy must find that the swap pays (`preemption_pays`).
        """
        if not self.policy.preemptive or not self.running:
            return None
        best = self.queue.peek(now)
        if best is None:
            return None
        best_key = self.queue.key_of(best)
        candidates = [j for j in self.running.values() if self.policy.can_be_preempted(j)]
        if not candidates:
            return None
        worst_key, _, _, victim = max(
            ((self.policy.key(j, now), j.arrival_s, j.id, j) for j in candidates),
            key=lambda r: r[:3],
        )
        if not best_key < worst_key:
            return None
        if margin > 0 and not _beats_by(best_key, worst_key, margin):
            return None
        running = list(self.running.values())
        if not self.policy.preemption_pays(best, victim, running, len(self.queue)):
            return None
        return victim

    def _key_with(self, job: Job, cached_tokens: int, now: float) -> Key:
        """The policy's key for `job` were `cached_tokens` of its prompt cached."""
        job.cached_tokens = cached_tokens
        return self.policy.key(job, now)

    def _start(self, job: Job, now: float) -> None:
        self.running[job.id] = job
        self.policy.on_start(job, now)
        self._review_at[job.id] = self.policy.next_review(job)

    def _stop(self, job: Job) -> None:
        del self.running[job.id]
        self._review_at.pop(job.id, None)


def _beats_by(better: Key, worse: Key, margin: float) -> bool:
    """Is `better` lower than `worse` by `margin` × |worse| in their first differing part?"""
    for b, w in zip(better, worse, strict=False):
        if b != w:
            return b <= w - margin * abs(w)
    return False
