"""FastServe-style skip-join multi-level feedback queue (MLFQ), measured in tokens.

Level l has a quantum of `quantum_tokens · 2^l` output tokens. A job skips the levels whose
quantum could not even cover its prefill: it joins at level ⌈log2(prompt / entry_prompt_tokens)⌉
(0 for short prompts). After using up its level's quantum it drops one level; the last level
keeps it. Lower levels go first, arrival order within a level. Being a pure function of the
job's prompt and attained tokens, the level needs no stored state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from policies.base import Key, Policy, param
from policies.job import Job
from policies.registry import register_policy


@register_policy
@dataclass(eq=False)
class FastServe(Policy):
    name = "fastserve"
    description = (
        "Skip-join MLFQ: entry level by prompt length, demotion after each level's quantum."
    )
    preemptive: bool = param(True, "preempt running jobs of a lower-priority level")
    quantum_tokens: int = param(32, "output tokens of the level-0 quantum; doubles per level")
    levels: int = param(8, "number of levels")
    entry_prompt_tokens: int = param(
        512, "prompt length the level-0 quantum covers; doubles per level"
    )

    def entry_level(self, job: Job) -> int:
        ratio = job.prompt_tokens / self.entry_prompt_tokens
        return min(self.levels - 1, max(0, math.ceil(math.log2(ratio)) if ratio > 1 else 0))

    def level_and_boundary(self, job: Job) -> tuple[int, int | None]:
        """Current level and the generated-token count at which the job is demoted next."""
        level, boundary = self.entry_level(job), 0
        while True:
            if level == self.levels - 1:
                return level, None
            boundary += self.quantum_tokens << level
            if job.generated < boundary:
                return level, boundary
            level += 1

    def key(self, job: Job, now: float) -> Key:
        return (float(self.level_and_boundary(job)[0]),)

    def next_review(self, job: Job) -> int | None:
        return self.level_and_boundary(job)[1]
