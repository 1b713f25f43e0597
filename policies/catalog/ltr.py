"""Learning to rank (after Fu et al., NeurIPS 2024) with a starvation guard.

The published method trains a model to *rank* prompts by output length (a pairwise/listwise
loss, not a length regression) and serves the lowest-ranked first. Here the ranking model is
`predictor.learners.PairwiseRanker`, a linear scorer on the prompt embedding trained online
with the pairwise logistic loss on completed requests; the engine hands its score to the job
(`Job.rank_score`). A job without a score (no ranker yet) falls back to the expected log length
of its predicted distribution.

Starvation guard: the paper promotes a request that was skipped too many times. Here a job is
promoted once `starvation_s` have passed since its arrival (the engines review waiting keys by
time, `review_at`, so the guard is expressed as time waited); promoted jobs go ahead of every
unpromoted one, in arrival order, so no job waits forever behind a stream of short ones.
Non-preemptive, as in the paper.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from policies.base import Key, Policy, param
from policies.job import Job
from policies.registry import register_policy


@register_policy
@dataclass(eq=False)
class LearningToRank(Policy):
    name = "ltr"
    description = "Order by a learned ranking score (pairwise loss); promote jobs starved too long."
    needs_prediction = True
    starvation_s: float = param(30.0, "waiting time after which a job is promoted (seconds)")

    def key(self, job: Job, now: float) -> Key:
        if now - job.arrival_s >= self.starvation_s:
            return (0.0, job.arrival_s)
        if job.rank_score is not None:
            return (1.0, job.rank_score)
        dist = job.remaining_dist()
        return (1.0, float(np.log(dist.support) @ dist.probs))

    def review_at(self, job: Job) -> float | None:
        return job.arrival_s + self.starvation_s
