"""Multi-turn chat sessions replayed live through the `openai` client (`sagesched replay
--sessions`).

A session is a real conversation of ShareGPT or MT-Bench (`loadgen.traces.sessions`): turn k
sends the user's messages 1..k with the recorded answers 1..k−1 as assistant turns, so every
turn resends the whole history, as a chat client does, and asks for as many tokens as the
recorded k-th answer has (MiniLM tokenizer count, `ignore_eos`; `--max-output` caps it).
Closed per session, open across sessions: sessions start by a Poisson process of
`session_rate` per second (seeded); a session's next turn is sent a think time after its
previous answer's last token (log-normal; default median 5 s, σ 1.67 as fitted on BurstGPT,
capped at 60 s: the fitted 136 s median would make a replay last hours). Each turn carries
the session's key in `X-SageSched-Session` (the gateway's `session` router reads it).

Latencies count from the moment a turn is due (session start, or previous answer + think
time), like the open-loop replay counts from the scheduled send. The report adds, as `vllm
bench serve`'s multi-turn benchmark does, TTFT and end-to-end latency per turn number: later
turns carry longer histories, which a prefix cache serves without recomputing.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from loadgen.metrics import distribution
from loadgen.replay.client import ReplayRequest, ReplayResult, make_client, send
from loadgen.traces.sessions import Dataset, ThinkTime, conversations, token_ids

SESSION_HEADER = "X-SageSched-Session"
"""The gateway's session header (`gateway.scheduling.routing.SESSION_HEADER`; loadgen does not
import
the gateway)."""
DEFAULT_THINK = ThinkTime(median_s=5.0, sigma=1.67, max_s=60.0)


@dataclass(frozen=True, slots=True)
class Session:
    """One conversation to replay: when it starts, its turns, the think time before each."""

    key: str
    start_s: float
    turns: tuple[ReplayRequest, ...]
    thinks_s: tuple[float, ...]
    """Think time before each turn (0 before the first)."""


@dataclass(slots=True)
class TurnResult:
    """One turn's outcome: which session, which turn (1-based), and the request's record."""

    session: int
    turn: int
    result: ReplayResult


def build_sessions(
    dataset: Dataset,
    n_sessions: int,
    session_rate: float,
    *,
    think: ThinkTime = DEFAULT_THINK,
    max_turns: int | None = None,
    min_turns: int = 1,
    max_output: int | None = None,
    max_context_tokens: int = 1_536,
    seed: int = 0,
) -> list[Session]:
    """`n_sessions` conversations of `dataset`, drawn without replacement (seeded), each cut
    before the first turn whose history + answer would pass `max_context_tokens` (the
    tokenizer's count; the tiny test model serves 2,048) or after `max_turns`; those left
    with fewer than `min_turns` turns are skipped."""
    if n_sessions < 1 or session_rate <= 0:
        raise ValueError("--num-sessions and --session-rate must be positive")
    convs = conversations(dataset)
    rng = np.random.default_rng(seed)
    picks = rng.permutation(len(convs))
    starts = np.cumsum(rng.exponential(1.0 / session_rate, n_sessions))
    out: list[Session] = []
    for pick in picks:
        if len(out) == n_sessions:
            break
        turns = _turns(convs[int(pick)][:max_turns], max_output, max_context_tokens)
        if len(turns) < max(1, min_turns):
            continue
        key = f"{dataset}-{seed}-{len(out)}"
        thinks = (0.0, *(float(t) for t in think.sample(rng, len(turns) - 1)))
        turns = tuple(ReplayRequest(0.0, "", r.prompt_tokens, r.output_tokens,
                                    messages=r.messages, headers={SESSION_HEADER: key})
                      for r in turns)  # fmt: skip
        out.append(Session(key, float(starts[len(out)] - starts[0]), turns, thinks))
    if len(out) < n_sessions:
        raise ValueError(f"{dataset} has only {len(out)} usable conversations")
    return out


def _turns(
    conv: Sequence[tuple[str, str]], max_output: int | None, max_context_tokens: int
) -> tuple[ReplayRequest, ...]:
    """Turn k: the history up to the k-th user message, and the k-th answer's length."""
    users = token_ids([u for u, _ in conv])
    answers = token_ids([a for _, a in conv])
    history: list[dict[str, str]] = []
    tokens = 0
    out = []
    for (user, answer), u_ids, a_ids in zip(conv, users, answers, strict=True):
        history.append({"role": "user", "content": user})
        tokens += len(u_ids)
        wanted = max(1, len(a_ids))
        output = min(wanted, max_output) if max_output else wanted
        if tokens + output > max_context_tokens:
            break
        out.append(ReplayRequest(0.0, "", tokens, output, messages=tuple(history)))
        history.append({"role": "assistant", "content": answer})
        tokens += len(a_ids)
    return tuple(out)


async def replay_sessions(
    url: str,
    model: str,
    sessions: Sequence[Session],
    *,
    timeout_s: float = 600.0,
    concurrency: int = 1024,
    on_done: Callable[[ReplayResult], None] | None = None,
) -> list[TurnResult]:
    """Replay `sessions` (start times relative to now); every turn's result, in session and
    turn order. A failed turn is recorded and its session goes on (the history it sends is
    the recorded one)."""
    results = [
        TurnResult(s, k + 1, ReplayResult(0, 0.0, req.prompt_tokens, req.output_tokens))
        for s, session in enumerate(sessions)
        for k, req in enumerate(session.turns)
    ]
    for i, r in enumerate(results):
        r.result.id = i
    first = [0]
    for session in sessions[:-1]:
        first.append(first[-1] + len(session.turns))
    gc.collect()
    gc.freeze()
    async with make_client(url, concurrency=concurrency, timeout_s=timeout_s) as client:
        t0 = time.perf_counter()

        async def run(s: int, session: Session) -> None:
            due = session.start_s
            for k, req in enumerate(session.turns):
                due += session.thinks_s[k]
                delay = t0 + due - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                res = results[first[s] + k].result
                res.scheduled_s = due
                await send(client, model, req, res, t0, on_done)
                due = res.finish_s if res.finish_s is not None else due

        await asyncio.gather(*(run(s, session) for s, session in enumerate(sessions)))
    return results


def by_turn(results: Sequence[TurnResult], last: int = 5) -> dict[str, dict[str, float]]:
    """TTFT and end-to-end latency (s) per turn number (turns ≥ `last` together)."""
    groups: dict[str, list[ReplayResult]] = {}
    for r in results:
        label = str(r.turn) if r.turn < last else f"{last}+"
        groups.setdefault(label, []).append(r.result)
    out = {}
    for label in sorted(groups, key=lambda x: int(x.rstrip("+"))):
        ok = [r for r in groups[label] if r.ok]
        row = {"turns": float(len(groups[label])), "failed": float(len(groups[label]) - len(ok))}
        row["prompt_tokens_mean"] = float(np.mean([r.prompt_tokens for r in ok])) if ok else 0.0
        row |= distribution([r.ttft_s for r in ok], "ttft_s")
        row |= distribution([r.ttlt_s for r in ok], "e2el_s")
        out[label] = row
    return out


def turn_table(rows: dict[str, dict[str, float]]) -> str:
    """The per-turn rows as a markdown table (ms)."""
    head = "| turn | turns | failed | prompt tokens (mean) | TTFT mean ms | TTFT p50 ms | " \
           "TTFT p99 ms | E2E mean ms | E2E p99 ms |"  # fmt: skip
    lines = [head, "|---|" + "---:|" * 8]
    for label, r in rows.items():
        cells = [label, f"{r['turns']:.0f}", f"{r['failed']:.0f}", f"{r['prompt_tokens_mean']:.0f}"]
        cells += [f"{r[k] * 1000:.1f}" for k in ("ttft_s_mean", "ttft_s_p50", "ttft_s_p99",
                                                 "e2el_s_mean", "e2el_s_p99")]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


__all__ = [
    "DEFAULT_THINK",
    "SESSION_HEADER",
    "Session",
    "TurnResult",
    "build_sessions",
    "by_turn",
    "replay_sessions",
    "turn_table",
]
