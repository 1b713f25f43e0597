"""Prompt block-hash chains: the prefix structure `TraceRequest.block_hashes` carries.

A prompt is cut into full blocks of `block_tokens` tokens (a trailing partial block is not
listed). Entry k of the chain identifies the whole prefix of blocks 0..k: it hashes (entry
k−1, block k's content), as vLLM's prefix cache keys its KV blocks. Two requests share a
cached prefix of k blocks iff their first k entries are equal (`shared_blocks`). Entries are
ints in [0, 2**63): deterministic across processes and machines (BLAKE2b, not Python's
salted `hash()`), and never negative, so a consumer may use negative numbers as its own keys.

Block content is the block's token ids (`chain_tokens`), an opaque per-block id of the trace
(`chain_ids`, e.g. Mooncake's `hash_ids`, whose equal prefixes mean a shared KV prefix), or,
where the gateway has no token ids, a block of the prompt's characters (`chain_text`, llm-d's
approximate mode: `TEXT_BLOCK_CHARS` characters stand for about `TEXT_BLOCK_TOKENS` tokens).
Standard library only.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Sequence

ROOT = 0
"""The parent of a prompt's first block."""
_MASK = (1 << 63) - 1


def chain(parent: int, content: bytes) -> int:
    """The chained hash of a block: 63 bits of BLAKE2b over (parent, content)."""
    h = hashlib.blake2b(parent.to_bytes(8, "little"), digest_size=8)
    h.update(content)
    return int.from_bytes(h.digest(), "little") & _MASK


def chain_ids(block_ids: Iterable[int]) -> tuple[int, ...]:
    """The chain over per-block ids (one id per full block, e.g. Mooncake's `hash_ids`)."""
    out: list[int] = []
    parent = ROOT
    for block_id in block_ids:
        parent = chain(parent, int(block_id).to_bytes(8, "little", signed=True))
        out.append(parent)
    return tuple(out)


def chain_tokens(token_ids: Sequence[int], block_tokens: int) -> tuple[int, ...]:
    """The chain over the full `block_tokens`-token blocks of a prompt's token ids."""
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    packed = array("q", token_ids).tobytes()
    step = 8 * block_tokens
    out: list[int] = []
    parent = ROOT
    for k in range(len(token_ids) // block_tokens):
        parent = chain(parent, packed[k * step : (k + 1) * step])
        out.append(parent)
    return tuple(out)


TEXT_BLOCK_CHARS = 64
"""Characters per block of `chain_text` (llm-d's approximate prefix scorer hashes 64)."""
TEXT_BLOCK_TOKENS = 16
"""Tokens a `TEXT_BLOCK_CHARS`-character block stands for (about four characters a token)."""


def chain_text(text: str, block_chars: int = TEXT_BLOCK_CHARS) -> tuple[int, ...]:
    """The chain over the full `block_chars`-character blocks of a prompt's text."""
    if block_chars < 1:
        raise ValueError(f"block_chars must be positive, got {block_chars}")
    out: list[int] = []
    parent = ROOT
    for k in range(len(text) // block_chars):
        block = text[k * block_chars : (k + 1) * block_chars]
        parent = chain(parent, block.encode("utf-8", "surrogatepass"))
        out.append(parent)
    return tuple(out)


def shared_blocks(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading blocks two chains share (their longest common prefix)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


__all__ = [
    "ROOT",
    "TEXT_BLOCK_CHARS",
    "TEXT_BLOCK_TOKENS",
    "chain",
    "chain_ids",
    "chain_text",
    "chain_tokens",
    "shared_blocks",
]
