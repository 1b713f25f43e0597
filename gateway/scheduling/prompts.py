"""Prompt size from the backend's own tokenizer (vLLM `/tokenize`).

The policy's cost model (kv, time) and the predictor's prompt band read a job's prompt
tokens. The characters / 4 estimate is off by 2× or more for code, non-English text and chat
templates, so a request that must wait in the queue is counted by the backend that will serve
it: `POST /tokenize` with the same `prompt`, or the same `messages` and template options
(vLLM applies the chat template, so the count equals the answer's `usage.prompt_tokens`).

Cost control, so counting never stalls a request:
- only a job that must queue is counted (a job that starts at once cannot be reordered; its
  true size comes back in the answer's usage), concurrently with its prediction;
- counts are cached per backend, LRU, keyed by a hash of the tokenize request (repeated
  system prompts and retries cost nothing);
- each count waits at most `timeout_s`; a backend that has no `/tokenize` (404, 405, 501) or
  timed out is not asked again for `retry_after_s`; any failure keeps the estimate.

Event-loop confined, like the pool it reads.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections import OrderedDict
from typing import Any

import aiohttp

from gateway.config import TokenizerSettings
from gateway.scheduling.backends import Backend, BackendPool
from gateway.serving.openai_api import Call
from policies.routing.chain import chain_tokens

log = logging.getLogger(__name__)

TOKENIZER, CACHE, ESTIMATE = "tokenizer", "cache", "estimate"
"""Where a count came from (the `source` label of `sagesched_prompt_counts_total`)."""
_CHAT_KEYS = (
    "add_generation_prompt",
    "continue_final_message",
    "chat_template",
    "chat_template_kwargs",
    "tools",
    "add_special_tokens",
)
"""Chat fields that change the templated prompt, sent to `/tokenize` as the client set them."""
_ABSENT = (404, 405, 501)


def tokenize_requests(call: Call) -> list[dict[str, Any]] | None:
    """The `/tokenize` bodies that size `call`'s prompt (one per prompt of a completions
    batch), or None when the estimate is exact or no body applies (token ids, responses)."""
    body = call.body
    if call.kind == "chat":
        extra = {k: body[k] for k in _CHAT_KEYS if k in body}
        return [{"model": call.model, "messages": body["messages"], **extra}]
    if call.kind != "completions":
        return None
    prompt = body.get("prompt")
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        return None  # token ids: counted exactly already
    return [{"model": call.model, "prompt": p} for p in prompts]


class PromptCounter:
    """Counts prompts on the backends; one per gateway."""

    def __init__(
        self, pool: BackendPool, session: aiohttp.ClientSession, settings: TokenizerSettings
    ) -> None:
        self._pool = pool
        self._session = session
        self._settings = settings
        self._caches: dict[str, OrderedDict[bytes, tuple[int, tuple[int, ...] | None]]] = {}
        self._skip_until: dict[str, float] = {}
        self._timeout = aiohttp.ClientTimeout(total=settings.timeout_s)

    async def count(self, call: Call) -> tuple[int, str, tuple[int, ...] | None]:
        """(prompt tokens, source, the prompt's token chain). The chain (this project's chain
        over the token ids, in the block size of the model's engines that publish KV events,
        `gateway.scheduling.kv_events`) is there only when such an engine exists and one prompt was
        tokenized. Never raises (but lets cancellation through) and returns within about
        `timeout_s`."""
        estimate = call.prompt_tokens_estimate, ESTIMATE, None
        requests = tokenize_requests(call)
        backend = self._pick(call.model)
        if requests is None or backend is None:
            return estimate
        block = self._pool.event_block_size(call.model) if len(requests) == 1 else None
        cache = self._caches.setdefault(backend.name, OrderedDict())
        keys = [_key(r) for r in requests]
        missing = [(k, r) for k, r in zip(keys, requests, strict=True) if k not in cache]
        if missing:
            try:
                async with asyncio.timeout(self._settings.timeout_s):
                    counts = await asyncio.gather(*(self._tokenize(backend, r) for _, r in missing))
            except TimeoutError:
                self._skip(backend, "timed out")
                return estimate
            except _Unavailable as exc:
                self._skip(backend, str(exc))
                return estimate
            except (aiohttp.ClientError, ValueError, KeyError, TypeError):
                return estimate  # a body the tokenizer refused, a connection lost: estimate
            for (key, _), (n, ids) in zip(missing, counts, strict=True):
                chain = chain_tokens(ids, block) if block and ids is not None else None
                cache[key] = n, chain
        total, chain = 0, None
        for key in keys:
            cache.move_to_end(key)
            n, chain = cache[key]
            total += n
        while len(cache) > self._settings.cache_entries:
            cache.popitem(last=False)
        return total, TOKENIZER if missing else CACHE, chain if block else None

    def _pick(self, model: str) -> Backend | None:
        """The least-loaded healthy backend of `model` that is not being skipped."""
        now = time.monotonic()
        open_ = [
            b
            for b in self._pool.backends
            if b.healthy and model in b.models and self._skip_until.get(b.name, 0.0) <= now
        ]
        return min(open_, key=lambda b: b.inflight / max(b.cap, 1), default=None)

    def _skip(self, backend: Backend, why: str) -> None:
        log.info(
            "backend %s: no prompt counts for %.0f s (%s)",
            backend.name,
            self._settings.retry_after_s,
            why,
        )
        self._skip_until[backend.name] = time.monotonic() + self._settings.retry_after_s

    async def _tokenize(
        self, backend: Backend, request: dict[str, Any]
    ) -> tuple[int, list[int] | None]:
        """(count, token ids if the answer lists them)."""
        async with self._session.post(
            backend.url + "/tokenize",
            json=request,
            headers=backend.headers(),
            timeout=self._timeout,
        ) as resp:
            if resp.status in _ABSENT:
                raise _Unavailable(f"/tokenize answered {resp.status}")
            if resp.status != 200:
                raise ValueError(f"/tokenize answered {resp.status}")
            data = await resp.json()
            tokens = data.get("tokens")
            return int(data["count"]), tokens if isinstance(tokens, list) else None


class _Unavailable(Exception):
    """The backend does not serve `/tokenize`."""


def _key(request: dict[str, Any]) -> bytes:
    text = json.dumps(request, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()
