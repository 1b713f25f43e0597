"""The emulator's token rules: prompt counts, natural lengths, output text, continuations.

Pure functions, no I/O (docs/emulator.md, "Deterministic rules"):

- prompt tokens: a string counts `ceil(1.3 × units)` where units are words and punctuation
  marks (`\\w+|[^\\w\\s]`); a list of token ids counts its length; a chat request adds 4 tokens
  per message plus 2 for the generation prompt;
- natural output length (no `ignore_eos`): `natural_output_tokens(text)`, a log-normal quantile
  of a SHA-256 hash of the prompt text;
- output text: token i of an answer is `" " + FILLER[(seed + 7·i) mod 62]`, seed being the
  same hash, one token per word;
- continuation: a prompt that ends with the first k tokens of its own answer (the gateway's
  resume after preemption: a final assistant message with `continue_final_message`, or, for
  completions, the text appended to the prompt) continues that answer at token k: same seed,
  same natural length, k tokens counted as k prompt tokens.
"""

from __future__ import annotations

import hashlib
import math
import re
from statistics import NormalDist

_UNITS = re.compile(r"\w+|[^\w\s]")
TOKENS_PER_UNIT = 1.3
CHAT_TOKENS_PER_MESSAGE = 4
CHAT_GENERATION_PROMPT_TOKENS = 2
NATURAL_MEDIAN_TOKENS = 128.0
"""Median of the natural output length (no `ignore_eos`)."""
NATURAL_SIGMA = 0.8
"""Log-normal shape of the natural output length."""
NATURAL_MAX_TOKENS = 1024
FILLER = (  # noqa: SIM905
    "the of and to in a is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there been one all we their has would when if so "
    "no will more can out up into do time than only other new some could these two may"
).split()
_FILLER_INDEX = {w: i for i, w in enumerate(FILLER)}
_STEP = 7
"""Token i+1's filler word is 7 places after token i's (mod 62)."""
MIN_APPENDED_CONTINUATION = 2
"""A completions prompt is read as a continuation only when it ends with at least this many
tokens of its own answer: a prompt that merely ends in one filler word would otherwise be
taken for one with probability 1/62."""
MAX_CONTINUATION_TOKENS = 4096
"""Bounds the backward scan of a completions prompt (one hash per candidate split)."""

# token ids of `tokenize`: structural ids, the filler vocabulary, other units hashed
_SPLIT_ID = 999
"""The extra piece of a unit counted as 2 tokens (1.3 tokens per unit on average)."""
_MESSAGE_IDS = (1, 2, 3, 4)
_GENERATION_IDS = (5, 6)
_FILLER_BASE = 1000
_HASHED_BASE, _HASHED_SPAN = 2000, 28000


def count_text_tokens(text: str) -> int:
    """Token count of a text (see module docstring); at least 1."""
    return max(1, math.ceil(TOKENS_PER_UNIT * len(_UNITS.findall(text))))


def digest(text: str) -> int:
    """First 8 bytes of SHA-256 of the text, big-endian."""
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big")


def natural_output_tokens(text: str) -> int:
    """Output length without `ignore_eos`: a stable function of the prompt text.

    u = (first 8 bytes of SHA-256(text) + 0.5) / 2⁶⁴; length = round(128 · exp(0.8 · Φ⁻¹(u))),
    clipped to [1, 1024]."""
    u = (digest(text) + 0.5) / 2.0**64
    n = round(NATURAL_MEDIAN_TOKENS * math.exp(NATURAL_SIGMA * NormalDist().inv_cdf(u)))
    return min(max(1, n), NATURAL_MAX_TOKENS)


def token_text(seed: int, i: int) -> str:
    """Text of output token `i` (0-based) of an answer whose prompt hashes to `seed`."""
    return " " + FILLER[(seed + i * _STEP) % len(FILLER)]


def answer_text(seed: int, start: int, stop: int) -> str:
    """Tokens `start` … `stop - 1` of the answer with this seed."""
    return "".join(token_text(seed, i) for i in range(start, stop))


def answered_tokens(prompt_text: str, content: str) -> int:
    """k if `content` is exactly the first k tokens of the answer to `prompt_text`, else 0
    (a chat continuation's final assistant message)."""
    words = content.split(" ")
    k = len(words) - 1
    if k < 1 or words[0] or content != answer_text(digest(prompt_text), 0, k):
        return 0
    return k


def split_appended(prompt: str) -> tuple[str, int]:
    """(original prompt, k) when `prompt` is an original prompt followed by the first k ≥ 2
    tokens of its own answer (a completions continuation), else (prompt, 0).

    Scans back over trailing filler words that follow the answer's progression, then checks
    the candidate splits, longest first, against the hash of the text before them."""
    end, later = len(prompt), -1
    candidates: list[tuple[int, int]] = []  # (split position, filler index of token 0)
    while len(candidates) < MAX_CONTINUATION_TOKENS:
        space = prompt.rfind(" ", 0, end)
        index = _FILLER_INDEX.get(prompt[space + 1 : end]) if space >= 0 else None
        if index is None or (later >= 0 and (later - index) % len(FILLER) != _STEP):
            break
        candidates.append((space, index))
        end, later = space, index
    for k in range(len(candidates), MIN_APPENDED_CONTINUATION - 1, -1):
        split, first = candidates[k - 1]
        if digest(prompt[:split]) % len(FILLER) == first:
            return prompt[:split], k
    return prompt, 0


def text_ids(text: str) -> list[int]:
    """Token ids of a text, `count_text_tokens(text)` of them: a filler word has its own id,
    any other unit a hashed one, and some units a second piece."""
    units = _UNITS.findall(text)
    ids: list[int] = []
    for j, unit in enumerate(units):
        index = _FILLER_INDEX.get(unit)
        if index is not None:
            ids.append(_FILLER_BASE + index)
        else:
            ids.append(_HASHED_BASE + digest(unit) % _HASHED_SPAN)
        pieces = math.ceil(TOKENS_PER_UNIT * (j + 1)) - math.ceil(TOKENS_PER_UNIT * j)
        ids.extend([_SPLIT_ID] * (pieces - 1))
    return ids or [_SPLIT_ID]


def answer_ids(seed: int, start: int, stop: int) -> list[int]:
    """Token ids of answer tokens `start` … `stop - 1` (one id per token)."""
    n = len(FILLER)
    return [_FILLER_BASE + (seed + i * _STEP) % n for i in range(start, stop)]


def message_ids() -> list[int]:
    """The 4 ids a chat message adds around its content."""
    return list(_MESSAGE_IDS)


def generation_prompt_ids() -> list[int]:
    """The 2 ids of the generation prompt (or of an open final assistant message's header)."""
    return list(_GENERATION_IDS)


def detokenize(ids: list[int]) -> str:
    """Text of token ids: filler ids give their words, structural and split ids nothing, any
    other id `<id>` (hashed ids cannot be inverted)."""
    out = []
    for t in ids:
        if _FILLER_BASE <= t < _FILLER_BASE + len(FILLER):
            out.append(" " + FILLER[t - _FILLER_BASE])
        elif t not in _MESSAGE_IDS and t not in _GENERATION_IDS and t != _SPLIT_ID:
            out.append(f" <{t}>")
    return "".join(out)
