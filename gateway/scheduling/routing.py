"""What a prefix router needs from a request: the prompt's block chain and its session.

The gateway never sees the engine's token ids of a text prompt (the backend's tokenizer has
them), so a text prompt is chained over blocks of its text, as llm-d's approximate prefix
scorer does (`policies.routing.chain.chain_text`: 64 bytes of UTF-8, taken for 16
tokens). The text is `Call.prompt_text`, rendered the same way every turn (the messages'
contents in order), so turn k+1 of a conversation, which resends turns 1..k and their
answers, starts with turn k's blocks. A prompt given as token ids is chained over them in
vLLM's 16-token blocks; a batch of prompts gets none. The chain is only made when the
configured router reads prefixes and there is more than one backend to choose from.

A client names a conversation with the `X-SageSched-Session` header (the `session` router's
key; the others ignore it).
"""

from __future__ import annotations

from gateway.serving.openai_api import Call
from policies.routing.chain import TEXT_BLOCK_TOKENS, chain_text, chain_tokens

SESSION_HEADER = "X-SageSched-Session"
ID_BLOCK_TOKENS = 16
"""Tokens per block when the prompt comes as token ids (vLLM's default block size)."""
MAX_SESSION_CHARS = 256
"""A longer session header is cut to this (it is only hashed)."""


def request_prefix(call: Call) -> tuple[tuple[int, ...], int]:
    """The prompt's block chain and the tokens each block stands for ((), 0 when it has no
    full block)."""
    prompt = call.body.get("prompt") if call.kind == "completions" else None
    if isinstance(prompt, list):  # token ids, or a batch of prompts (not chained)
        if not all(_is_id(t) for t in prompt):
            return (), 0
        chain = chain_tokens(prompt, ID_BLOCK_TOKENS)
        return chain, ID_BLOCK_TOKENS if chain else 0
    chain = chain_text(call.prompt_text)
    return chain, TEXT_BLOCK_TOKENS if chain else 0


def session_key(header: str | None) -> str | None:
    """The conversation key a client sent, or None."""
    if header is None or not header.strip():
        return None
    return header.strip()[:MAX_SESSION_CHARS]


def _is_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63
