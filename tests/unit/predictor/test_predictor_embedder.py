from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest

from predictor import AsyncEmbedder, Embedder, EmbedderClosedError, ModelNotFoundError, model_path


def test_vectors_are_normalised_and_semantic(embedder: Embedder) -> None:
    v = embedder.encode(
        [
            "Write a long essay about the French revolution.",
            "Compose a detailed essay on the history of the French Revolution.",
            "What is 2 + 2?",
        ]
    )
    assert v.shape == (3, embedder.dim) and v.dtype == np.float32
    assert np.allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-4)
    assert float(v[0] @ v[1]) > float(v[0] @ v[2]) + 0.3
    assert embedder.encode([]).shape == (0, embedder.dim)


def test_missing_model_is_a_clear_error_not_a_download(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="never downloads"):
        Embedder(tmp_path / "nowhere")
    with pytest.raises(ModelNotFoundError, match="lacks"):
        model_path(tmp_path)
    assert (model_path() / "model.safetensors").is_file()


async def test_concurrent_calls_are_batched_and_match_sync(embedder: Embedder) -> None:
    texts = [f"question number {i} about cooking pasta" for i in range(20)]
    async with AsyncEmbedder(embedder, max_batch_items=8, max_wait_ms=20) as front:
        out = await asyncio.gather(*(front.embed(t) for t in texts))
        assert 3 <= front.batches < 20  # 20 callers, batches of at most 8
    want = embedder.encode(texts)
    assert np.allclose(np.stack(out), want, atol=1e-5)


async def test_embedding_never_blocks_the_loop(embedder: Embedder) -> None:
    """A ticker on the loop keeps running while 64 long prompts are embedded."""
    gaps: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0.002)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    texts = [f"{i} " + "please explain this in detail " * 12 for i in range(32)]
    tick = asyncio.create_task(ticker())
    async with AsyncEmbedder(embedder, max_batch_items=64, max_wait_ms=1) as front:
        t0 = time.perf_counter()
        await asyncio.gather(*(front.embed(t) for t in texts))
        busy = time.perf_counter() - t0
    stop.set()
    await tick
    assert busy > 0.1  # the model really worked for a while...
    assert max(gaps) < 0.1  # ...and the loop stayed responsive throughout


async def test_close_fails_pending_and_later_calls(embedder: Embedder) -> None:
    front = AsyncEmbedder(embedder, max_batch_items=1, max_wait_ms=0)
    tasks = [asyncio.create_task(front.embed(f"text {i} " * 50)) for i in range(6)]
    await asyncio.sleep(0.01)
    await front.close()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    failed = [r for r in results if isinstance(r, BaseException)]
    assert failed and all(isinstance(r, EmbedderClosedError) for r in failed)
    with pytest.raises(EmbedderClosedError):
        await front.embed("late")


async def test_cancelled_caller_does_not_break_the_batch(embedder: Embedder) -> None:
    async with AsyncEmbedder(embedder, max_batch_items=4, max_wait_ms=30) as front:
        doomed = asyncio.create_task(front.embed("never mind"))
        kept = asyncio.create_task(front.embed("keep me"))
        await asyncio.sleep(0)
        doomed.cancel()
        vec = await kept
        assert vec.shape == (embedder.dim,)
        assert doomed.cancelled()


async def test_work_after_the_embedding_runs_in_the_batch_and_fails_alone(
    embedder: Embedder,
) -> None:
    """`embed_then`: each caller's work runs on the worker after its batch's forward pass
    (one batch for all), and one caller's failing work fails that caller only."""
    import threading

    texts = [f"after-work text {i} about sailing" for i in range(6)]

    def norm(vec: np.ndarray) -> tuple[float, str]:
        return float(np.linalg.norm(vec)), threading.current_thread().name

    def boom(vec: np.ndarray) -> None:
        raise ArithmeticError("this caller's own")

    async with AsyncEmbedder(embedder, max_batch_items=16, max_wait_ms=30) as front:
        out = await asyncio.gather(
            *(front.embed_then(t, norm) for t in texts), front.embed_then("x y z", boom),
            return_exceptions=True,
        )  # fmt: skip
        assert front.batches == 1
    assert isinstance(out[-1], ArithmeticError)
    assert all(isinstance(r, tuple) and r[0] == pytest.approx(1.0, abs=1e-4) for r in out[:-1])
    assert all(r[1].startswith("embedder") for r in out[:-1])  # type: ignore[index]


def test_threads_setting_applies(embedder: Embedder) -> None:
    """The fixture asked for one intra-op thread; it reaches the default (ONNX) backend's
    session, and torch's process-wide setting when the reference backend is built."""
    from predictor.encoders import OnnxEncoder

    encoder = embedder._encoder
    assert isinstance(encoder, OnnxEncoder) and embedder.backend == "onnx-int8"
    assert encoder._session.get_session_options().intra_op_num_threads == 1
    Embedder(device="cpu", torch_threads=1, backend="torch", cache_items=0)
    import torch

    assert torch.get_num_threads() == 1


def test_a_lazy_embedder_loads_its_model_at_the_first_embedding(
    embedder: Embedder, tmp_path: Path
) -> None:
    """Built `lazy`, the embedder knows its dimension from the folder and holds no model until
    it is asked to embed; then it embeds exactly as an eager one. A folder declaring another
    size than its model gives is refused at the load, not served with wrong-sized rows."""
    import shutil

    lazy = Embedder(device="cpu", torch_threads=1, cache_items=0, lazy=True)
    assert not lazy.loaded and lazy.dim == embedder.dim == 384
    assert lazy.cached("never embedded") is None and not lazy.loaded
    texts = ["How do I bake bread?", "Explain the causes of the First World War in detail."]
    assert np.allclose(lazy.encode(texts), embedder.encode(texts), atol=1e-6)
    assert lazy.loaded and embedder.loaded
    wrong = tmp_path / "model"
    shutil.copytree(model_path(), wrong)
    pooling = wrong / "1_Pooling" / "config.json"
    pooling.write_text(pooling.read_text().replace('"word_embedding_dimension": 384',
                                                   '"word_embedding_dimension": 512'))  # fmt: skip
    declared = Embedder(wrong, cache_items=0, lazy=True, onnx_cache_dir=str(tmp_path / "onnx"))
    assert declared.dim == 512  # what the folder says; its weights give 384
    with pytest.raises(ModelNotFoundError, match="declares 512-d"):
        declared.encode(["a prompt"])
    assert not declared.loaded
