"""The study's semantic arm hands `ltr` the predictor's ranking scores (`Task.rank_scores`):
the same workload and beliefs with an oracle ranking and an anti-oracle ranking give `ltr`
different results, and no other contender moves."""

from __future__ import annotations

import dataclasses

import numpy as np

from loadgen.schema import TraceRequest
from loadgen.study.sagesched_eval import COMPUTE, Result, Task, run_task
from policies.dist import LengthDist


def _task(ranks: tuple[float, ...]) -> Task:
    rng = np.random.default_rng(3)
    outs = rng.integers(20, 600, size=120)
    reqs = tuple(TraceRequest(0.02 * i, 200, int(o), "test") for i, o in enumerate(outs))
    flat = LengthDist(np.array([300.0]), np.array([1.0]))  # beliefs that order nothing
    regime = dataclasses.replace(COMPUTE, cap=8)
    return Task("test", 1.0, 0, reqs, (("semantic", (flat,) * len(reqs), 0.0),), regime, ranks)


def _ttlt(rows: list[Result], policy: str) -> float:
    return next(r.value for r in rows if r.policy == policy and r.metric == "ttlt_s_mean")


def test_ltr_ranks_by_the_tasks_rank_scores() -> None:
    lengths = [r.output_tokens for r in _task(()).requests]
    oracle = run_task(_task(tuple(float(n) for n in lengths)))
    anti = run_task(_task(tuple(-float(n) for n in lengths)))
    assert _ttlt(oracle, "ltr") < 0.8 * _ttlt(anti, "ltr")
    assert _ttlt(oracle, "fcfs") == _ttlt(anti, "fcfs")
