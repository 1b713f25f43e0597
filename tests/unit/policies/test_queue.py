"""PolicyQueue pops in key order under any interleaving of push / remove / rekey / pop."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from policies import Job, Key, Policy, PolicyQueue


@dataclass(eq=False)
class ByScore(Policy):
    """Test policy: the key is a mutable score kept on the job's ctx."""

    name = "test-score"
    description = "test"

    def key(self, job: Job, now: float) -> Key:
        return (float(job.ctx),)


ops = st.lists(
    st.tuples(
        st.sampled_from(["push", "remove", "rekey", "pop"]), st.integers(0, 30), st.integers(0, 9)
    ),
    max_size=300,
)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_pops_in_key_order_under_any_interleaving(steps: list[tuple[str, int, int]]) -> None:
    q = PolicyQueue(ByScore())
    model: dict[int, Job] = {}  # the reference: what should be waiting
    jobs = {i: Job(id=i, arrival_s=float(i % 7), prompt_tokens=1, ctx=0) for i in range(31)}
    for op, i, score in steps:
        job = jobs[i]
        if op == "push" and i not in model:
            job.ctx = score
            q.push(job, 0.0)
            model[i] = job
        elif op == "remove":
            assert q.remove(job) == (i in model)
            model.pop(i, None)
        elif op == "rekey" and i in model:
            job.ctx = score
            q.rekey(job, 0.0)
        elif op == "pop":
            got = q.pop(0.0)
            if not model:
                assert got is None
                continue
            expected = min(model.values(), key=lambda j: (j.ctx, j.arrival_s, j.id))
            assert got is expected
            del model[expected.id]
        assert len(q) == len(model)
    drained = []
    while (j := q.pop(0.0)) is not None:
        drained.append(j)
    assert drained == sorted(model.values(), key=lambda j: (j.ctx, j.arrival_s, j.id))


def test_iteration_and_snapshot_are_in_key_order() -> None:
    q = PolicyQueue(ByScore())
    jobs = [Job(id=i, arrival_s=0.0, prompt_tokens=1, ctx=s) for i, s in enumerate([5, 1, 3])]
    for j in jobs:
        q.push(j, 0.0)
    assert [j.id for j in q] == [1, 2, 0]
    assert [(j.id, k) for j, k in q.snapshot(0.0)] == [(1, (1.0,)), (2, (3.0,)), (0, (5.0,))]
    assert q.peek(0.0) is jobs[1] and len(q) == 3
    assert jobs[0] in q and Job(id=0, arrival_s=0, prompt_tokens=1) not in q


def test_heap_compacts_after_many_rekeys() -> None:
    q = PolicyQueue(ByScore())
    job = Job(id=1, arrival_s=0.0, prompt_tokens=1, ctx=0)
    q.push(job, 0.0)
    for s in range(10_000):
        job.ctx = s
        q.rekey(job, 0.0)
    assert len(q._heap) < 200  # stale entries are dropped, not hoarded
    assert q.pop(0.0) is job and q.pop(0.0) is None
