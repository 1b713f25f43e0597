"""Windows: N consecutive requests, chosen by a seeded, outcome-blind stratified stride sampler.

The sampler sees only the trace's length (number of requests), never arrivals or token counts,
so window choice cannot favour any policy. The trace's index range [0, n_total) is cut into
`count` equal strata; in each stratum one window start is drawn uniformly (numpy PCG64 seeded
with `seed`) among the starts that keep the whole window inside the stratum. Windows therefore
never overlap and spread evenly over the trace (time of day, load level). When the strata are
exactly `n_requests` long there is nothing to draw and the seed has no effect.

A window is rebased so its first request arrives at t = 0 (deadlines move with it).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from loadgen.schema import TraceRequest, Window

SAMPLER = "stratified_stride_v1"
"""Name of the sampler below, recorded in every window's meta and in the frozen manifests."""


def default_count(n_total: int, n_requests: int) -> int:
    """Windows taken when the caller gives no count: strata at least twice a window long.

    That leaves each window at least `n_requests` starts to choose from (so seeds matter),
    with at least one window whenever the trace holds one.
    """
    if n_total < n_requests:
        return 0
    return max(1, n_total // (2 * n_requests))


def stride_starts(n_total: int, n_requests: int, count: int | None, seed: int) -> list[int]:
    """Start indices of `count` non-overlapping windows of `n_requests` in a trace of `n_total`.

    `count=None` means `default_count`. Raises `ValueError` if the windows cannot fit.
    Deterministic for a given (n_total, n_requests, count, seed).
    """
    if n_requests < 1:
        raise ValueError(f"n_requests must be >= 1, got {n_requests}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    if count is None:
        count = default_count(n_total, n_requests)
    fit = n_total // n_requests
    if count < 0 or count > fit:
        raise ValueError(
            f"cannot take {count} windows of {n_requests} from {n_total} requests (at most {fit})"
        )
    rng = np.random.default_rng(seed)
    starts: list[int] = []
    for i in range(count):
        lo = (i * n_total) // count
        last = ((i + 1) * n_total) // count - n_requests  # last start inside the stratum
        starts.append(lo + int(rng.integers(0, last - lo + 1)))
    return starts


def rebase(requests: Sequence[TraceRequest]) -> tuple[TraceRequest, ...]:
    """Shift arrivals (and deadlines) so the first request arrives at t = 0 s."""
    if not requests:
        return ()
    t0 = requests[0].arrival_s
    return tuple(
        replace(
            r,
            arrival_s=r.arrival_s - t0,
            deadline_s=None if r.deadline_s is None else r.deadline_s - t0,
        )
        for r in requests
    )


def window_id(source: str, seed: int, index: int) -> str:
    """Stable id of the `index`-th sampled window of `source` under `seed`."""
    return f"{source}_s{seed}_w{index:02d}"


def sample_windows(
    source: str,
    requests: Sequence[TraceRequest],
    *,
    n_requests: int,
    count: int | None,
    seed: int,
) -> list[Window]:
    """Cut `count` rebased windows out of a full trace (in arrival order) with the sampler."""
    starts = stride_starts(len(requests), n_requests, count, seed)
    return [
        Window(
            source=source,
            window_id=window_id(source, seed, i),
            requests=rebase(requests[start : start + n_requests]),
            meta={"sampler": SAMPLER, "seed": seed, "start_index": start},
        )
        for i, start in enumerate(starts)
    ]


def window_digest(window: Window) -> str:
    """SHA-256 (hex) of a window's request fields, for manifests and equality checks.

    Floats enter as `repr`, so two windows digest equal only if every value is bit-identical.
    """
    h = hashlib.sha256()
    for r in window.requests:
        fields: tuple[str, ...] = (
            repr(r.arrival_s),
            str(r.prompt_tokens),
            str(r.output_tokens),
            r.source,
            str(r.tenant),
            str(r.session),
            str(r.predicted_output_tokens),
            repr(r.deadline_s),
        )
        if r.block_tokens or r.think_s is not None:  # prefix and session fields, when present
            fields += (str(r.block_tokens), " ".join(map(str, r.block_hashes)), repr(r.think_s))
        h.update(("\t".join(fields) + "\n").encode())
    return h.hexdigest()
