"""The replay sends a request's vLLM `priority` when it has one (the reversal check plays
SLAI's shortest-prompt-first admission this way), against the emulator's priority scheduling."""

from __future__ import annotations

import random

import pytest
from fixtures.emulator_fixtures import StartEmulator

from loadgen.replay import ReplayRequest, replay
from loadgen.replay.prompts import token_ids


def _three(priorities: tuple[int | None, int | None, int | None]) -> list[ReplayRequest]:
    """A long request that holds the only sequence slot, then two short ones arriving while
    it runs: `low`, then `high`."""
    rng = random.Random(0)
    times, outs = (0.0, 0.05, 0.1), (120, 2, 2)
    return [ReplayRequest(t, token_ids(16, rng), 16, o, priority=p)
            for t, o, p in zip(times, outs, priorities, strict=True)]  # fmt: skip


@pytest.mark.parametrize(
    ("priorities", "high_first"), [((0, 10, -5), True), ((None, None, None), False)]
)
async def test_priority_reaches_the_server(
    start_emulator: StartEmulator, priorities: tuple[int | None, ...], high_first: bool
) -> None:
    url = await start_emulator(priority_scheduling=True, max_num_seqs=1)
    busy, low, high = await replay(url, "tiny-llama", _three(priorities))  # type: ignore[arg-type]
    assert busy.ok and low.ok and high.ok
    assert busy.finish_s is not None and low.finish_s is not None and high.finish_s is not None
    assert low.sent_s is not None and high.sent_s is not None
    assert high.sent_s < busy.finish_s  # both waited behind the long one
    assert (high.finish_s < low.finish_s) == high_first
