"""What the replay sends: prompts with known token counts and the output lengths to enforce.

Four prompt kinds, all with the trace's output length enforced by `max_tokens` + `ignore_eos`:

- **token ids** (`ids`): seeded random token ids, exact prompt length on any vLLM-compatible
  server, no prefix-cache hits; the gateway sees only the size.
- **synthetic text** (`text`): filler words adjusted through the server's `/tokenize` until the
  count is exact for the target's tokenizer; falls back to token ids where `/tokenize` is
  missing (the emulator and the gateway have none).
- **real prompts** (`sample` or a JSONL path of `{prompt, output_tokens}`): each request gets
  the prompt whose recorded answer length is closest to the trace's output length, so the
  gateway's semantic predictor sees real text. `sample` is the frozen ShareGPT sample shipped
  in `loadgen/data/prompts/` (see its PROVENANCE.md).
- **nearest shipped prompts** (`nearest`, a capture with embeddings only): each request gets
  the shipped prompt nearest to its recorded prompt embedding (`loadgen.replay.nearest`;
  `row_requests` builds them, token ids where a request has no embedding).

Arrivals come from a trace window (`loadgen.traces` + `loadgen.regions`), or, for a prompt
dataset alone, from a Poisson (burstiness 1) or gamma process at a given rate.
"""

from __future__ import annotations

import gzip
import json
import math
import random
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadgen.replay.client import Prompt, ReplayRequest
from loadgen.schema import TraceRequest

SAMPLE_PATH = Path(__file__).resolve().parent.parent / "data" / "prompts" / "sharegpt-400.jsonl.gz"
FILLER = ("the of and to in is that for it as with was on be at by this had not are but").split()  # noqa: SIM905


@dataclass(frozen=True, slots=True)
class PromptRow:
    prompt: str
    output_tokens: int
    prompt_tokens: int | None = None


def load_prompt_rows(path: str | Path | None = None) -> list[PromptRow]:
    """Rows of a JSONL (optionally .gz) of `{prompt, output_tokens[, prompt_tokens]}`;
    `None` or "sample": the frozen sample."""
    p = SAMPLE_PATH if path in (None, "sample") else Path(str(path))
    opener = gzip.open if p.suffix == ".gz" else open
    rows = []
    with opener(p, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                d = json.loads(line)
                rows.append(PromptRow(d["prompt"], int(d["output_tokens"]), d.get("prompt_tokens")))
    if not rows:
        raise ValueError(f"no prompts in {p}")
    return rows


def synthetic_window(
    n: int = 40,
    rate_per_s: float = 3.0,
    seed: int = 0,
    *,
    max_prompt: int = 1024,
    max_output: int = 256,
) -> list[TraceRequest]:
    """`n` ShareGPT-like requests: Poisson arrivals, log-normal prompt (median 200 tokens,
    σ 1.0) and output (median 80, σ 0.8) lengths, clipped to fit the tiny model."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate_per_s)
        p = min(max_prompt, max(8, round(200 * math.exp(rng.gauss(0.0, 1.0)))))
        o = min(max_output, max(4, round(80 * math.exp(rng.gauss(0.0, 0.8)))))
        out.append(TraceRequest(t, p, o, "synthetic"))
    return out


def arrivals(n: int, rate_per_s: float, *, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """`n` arrival times (s) of a gamma renewal process with mean rate `rate_per_s` and shape
    `burstiness` (1: Poisson; < 1 burstier), as `vllm bench serve --burstiness`."""
    if rate_per_s <= 0 or burstiness <= 0:
        raise ValueError("rate and burstiness must be positive")
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.gammavariate(burstiness, 1.0 / (rate_per_s * burstiness))
        out.append(t)
    return out


def token_ids(n: int, rng: random.Random) -> list[int]:
    """`n` random token ids in a range every Llama-family vocabulary has."""
    return [rng.randrange(1000, 30000) for _ in range(n)]


def exact_text(n_tokens: int, count: Callable[[str], int], prefix: str = "") -> str | None:
    """`prefix` followed by filler text, measured by `count` (the server's tokenizer) at
    exactly `n_tokens`, or None if it cannot be hit. Binary search on the number of filler
    words (at least one token each) for the longest text within `n_tokens`, then pad with
    one-token words ("a")."""

    def text(k: int) -> str:
        body = " ".join(FILLER[i % len(FILLER)] for i in range(k))
        return f"{prefix} {body}" if prefix and body else prefix or body

    lo, hi = 0, max(1, n_tokens)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(text(mid)) <= n_tokens:
            lo = mid
        else:
            hi = mid - 1
    if lo == 0 and not prefix:
        return None
    out = text(lo)
    missing = n_tokens - count(out)
    if missing > 0:
        out += " a" * missing
    return out if count(out) == n_tokens else None


def leading_words(text: str, n_tokens: int, count: Callable[[str], int]) -> str:
    """The longest run of `text`'s leading words that `count` measures at most `n_tokens`."""
    words = text.split(" ")
    lo, hi = 0, len(words)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(" ".join(words[:mid])) <= n_tokens:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(words[:lo])


def match_prompts(
    targets: Sequence[int], rows: Sequence[PromptRow], seed: int = 0
) -> list[PromptRow]:
    """For each target output length, the row whose recorded output length is closest (in
    log space), used at most once while unused rows remain; ties broken by a seeded shuffle."""
    rng = random.Random(seed)
    pool = list(rows)
    rng.shuffle(pool)
    pool.sort(key=lambda r: r.output_tokens)
    keys = [math.log(max(r.output_tokens, 1)) for r in pool]
    used = [False] * len(pool)
    left = len(pool)
    out = []
    for target in targets:
        if left == 0:
            used, left = [False] * len(pool), len(pool)
        k = math.log(max(target, 1))
        best = min((i for i in range(len(pool)) if not used[i]), key=lambda i: abs(keys[i] - k))
        used[best] = True
        left -= 1
        out.append(pool[best])
    return out


def build_requests(
    trace: Sequence[TraceRequest],
    *,
    prompts: str = "ids",
    seed: int = 0,
    count_tokens: Callable[[str], int] | None = None,
    max_output: int | None = None,
    pad: bool = False,
) -> list[ReplayRequest]:
    """Replay requests for `trace` (arrivals, deadlines and output lengths kept; output capped
    at `max_output`). `prompts`: `ids`, `text` (needs `count_tokens`, else ids), `sample` or a
    JSONL path. With `pad` and `count_tokens`, a real prompt shorter than the trace's prompt
    is padded with filler words to the trace's exact length (the text the predictor reads
    comes first; the engine sees the trace's prefill work)."""
    rng = random.Random(seed)
    outs = [r.output_tokens if max_output is None else min(r.output_tokens, max_output)
            for r in trace]  # fmt: skip
    if prompts in ("ids", "text"):
        cache: dict[int, str | None] = {}
        reqs = []
        for r, o in zip(trace, outs, strict=True):
            body: str | list[int] | None = None
            if prompts == "text" and count_tokens is not None:
                if r.prompt_tokens not in cache:
                    cache[r.prompt_tokens] = exact_text(r.prompt_tokens, count_tokens)
                body = cache[r.prompt_tokens]
            if body is None:
                body = token_ids(r.prompt_tokens, rng)
            reqs.append(ReplayRequest(r.arrival_s, body, r.prompt_tokens, o, r.deadline_s))
        return reqs
    rows = match_prompts(outs, load_prompt_rows(prompts), seed)
    return row_requests(trace, rows, seed=seed, count_tokens=count_tokens,
                        max_output=max_output, pad=pad)  # fmt: skip


def row_requests(
    trace: Sequence[TraceRequest],
    rows: Sequence[PromptRow | None],
    *,
    seed: int = 0,
    count_tokens: Callable[[str], int] | None = None,
    max_output: int | None = None,
    pad: bool = False,
) -> list[ReplayRequest]:
    """Replay requests sending `rows[i]`'s prompt for `trace[i]` (arrival, deadline and
    output length of the trace; output capped at `max_output`). With `pad` and
    `count_tokens`, a prompt shorter than the trace's is padded with filler words to the
    trace's exact length, and a longer one cut to its leading words first. Where `rows[i]` is
    None: seeded token ids of the trace's length."""
    rng = random.Random(seed)
    out = []
    for r, row in zip(trace, rows, strict=True):
        o = r.output_tokens if max_output is None else min(r.output_tokens, max_output)
        body: Prompt
        if row is None:
            body, size = token_ids(r.prompt_tokens, rng), r.prompt_tokens
        elif pad and count_tokens is not None:
            prompt = row.prompt
            if count_tokens(prompt) > r.prompt_tokens:  # longer than the trace's: its start
                prompt = leading_words(prompt, r.prompt_tokens - 1, count_tokens)
            padded = exact_text(r.prompt_tokens, count_tokens, prefix=prompt)
            if padded is None:  # no fit (a tokenizer merging across the cut): as it is
                body, size = row.prompt, count_tokens(row.prompt)
            else:
                body, size = padded, r.prompt_tokens
        else:
            body, size = row.prompt, row.prompt_tokens or r.prompt_tokens
        out.append(ReplayRequest(r.arrival_s, body, size, o, r.deadline_s))
    return out


def dataset_requests(
    n: int,
    rate_per_s: float,
    *,
    path: str | None = None,
    burstiness: float = 1.0,
    seed: int = 0,
    max_output: int | None = None,
) -> list[ReplayRequest]:
    """`n` prompts of a dataset (their own output lengths) at Poisson/gamma arrivals."""
    rows = load_prompt_rows(path)
    rng = random.Random(seed)
    times = arrivals(n, rate_per_s, burstiness=burstiness, seed=seed)
    picked = [rows[rng.randrange(len(rows))] for _ in range(n)]
    return [
        ReplayRequest(t, row.prompt, row.prompt_tokens or max(1, len(row.prompt) // 4),
                      row.output_tokens if max_output is None else min(row.output_tokens,
                                                                        max_output))
        for t, row in zip(times, picked, strict=True)
    ]  # fmt: skip


def http_json(url: str, body: object = None, timeout_s: float = 10.0) -> Any:
    """GET (or POST `body` as JSON) and decode the JSON answer; raises OSError on failure."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read())


def tokenize_counter(url: str, model: str, timeout_s: float = 5.0) -> Callable[[str], int] | None:
    """A token counter through the server's `/tokenize` (vLLM), or None if it has none."""
    endpoint = url.rstrip("/") + "/tokenize"

    def count(text: str) -> int:
        return int(http_json(endpoint, {"model": model, "prompt": text}, timeout_s)["count"])

    try:
        count("hello")
    except (OSError, KeyError, ValueError):
        return None
    return count
