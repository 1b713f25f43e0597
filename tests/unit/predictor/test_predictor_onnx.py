"""The ONNX embedder against the PyTorch reference (real model, real export), its tokenization,
the export cache and the embedding cache."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from predictor import AsyncEmbedder, Embedder, PredictorConfig, model_path
from predictor.datasets import load_pairs
from predictor.encoders import OnnxEncoder, TorchEncoder
from predictor.onnx_export import model_digest, onnx_file
from predictor.text import clip_text

HANDWRITTEN = [
    "What is the capital of Peru?",
    "Write a haiku about autumn leaves.",
    "  leading and trailing spaces, TABS\tand\nnewlines  ",
    "Ünïcödé, emoji 🚀 and 中文 mixed in one prompt.",
    "Explain in depth how TCP congestion control works, with examples. " * 60,  # > 256 pieces
]
TINY = ["x", "hi", "ok?", "Why?", "2+2", "thanks", "yes or no", "Hello there"]
"""One to three words: int8 agrees least here (docs/benchmarks.md, "ONNX embedder")."""


@pytest.fixture(scope="module")
def torch_embedder() -> Embedder:
    """The reference path: sentence-transformers on torch, one thread, no cache."""
    return Embedder(device="cpu", torch_threads=1, backend="torch", cache_items=0)


@pytest.fixture(scope="module")
def prompts(shared_data: Path) -> list[str]:
    """Hand-written edge cases and 60 real ShareGPT prompts, clipped as the gateway clips."""
    real = [p for _, p, _ in load_pairs("sharegpt", shared_data)[:60]]
    cfg = PredictorConfig()
    return HANDWRITTEN + [clip_text(p, cfg.embed_max_chars, cfg.embed_head_fraction) for p in real]


@pytest.mark.parametrize("backend", ["onnx", "onnx-int8"])
def test_onnx_agrees_with_pytorch(
    backend: str, torch_embedder: Embedder, prompts: list[str]
) -> None:
    """Cosine to the PyTorch path >= 0.99 on every real prompt, at batch 1 and 16; the fp32
    export is the same function up to rounding, on every prompt; int8 on 1-3 words >= 0.95."""
    onnx = Embedder(device="cpu", torch_threads=1, backend=backend, cache_items=0)
    for texts, floor in ((prompts, 0.99), (TINY, 0.9999 if backend == "onnx" else 0.95)):
        want = torch_embedder.encode(texts)
        for batch in (1, 16):  # padding within a forward pass must not change a row
            got = onnx.encode(texts, batch_size=batch)
            assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-4)
            cosine = np.sum(want * got, axis=1)
            worst = texts[int(cosine.argmin())][:80]
            assert cosine.min() >= floor, (backend, batch, float(cosine.min()), worst)
            if backend == "onnx":
                assert cosine.min() >= 0.9999


def test_tokenization_matches_sentence_transformers(
    torch_embedder: Embedder, prompts: list[str]
) -> None:
    onnx = Embedder(device="cpu", backend="onnx-int8", cache_items=0)
    encoder = onnx._encoder
    reference = torch_embedder._encoder
    assert isinstance(encoder, OnnxEncoder) and isinstance(reference, TorchEncoder)
    st = reference.model
    assert encoder.max_tokens == st.max_seq_length == 256
    features = st.tokenizer(
        prompts, padding=True, truncation="longest_first", max_length=st.max_seq_length
    )
    want = [
        [i for i, m in zip(ids, mask, strict=True) if m]
        for ids, mask in zip(features["input_ids"], features["attention_mask"], strict=True)
    ]
    got = encoder.tokenize(prompts)
    assert got == want
    assert max(len(x) for x in got) == 256  # the long prompt was truncated, not dropped


def test_export_is_cached_keyed_and_atomic(tmp_path: Path) -> None:
    """First call exports (fp32, then int8 from it); later calls reuse the files; no temporary
    file is left; another model folder (different graph files) gets another folder."""
    cache = tmp_path / "onnx"
    int8 = onnx_file("int8", cache_dir=cache)
    fp32 = int8.with_name("model-fp32.onnx")
    assert int8.is_file() and fp32.is_file()
    assert int8.parent.name == f"{model_path().name}-{model_digest(model_path())}"
    assert sorted(p.name for p in int8.parent.iterdir()) == ["model-fp32.onnx", "model-int8.onnx"]
    # int8 MatMul weights (the 47 MB word-embedding table stays fp32)
    assert int8.stat().st_size < 0.85 * fp32.stat().st_size
    stamps = (fp32.stat().st_mtime_ns, int8.stat().st_mtime_ns)
    assert onnx_file("int8", cache_dir=cache) == int8
    assert onnx_file("fp32", cache_dir=cache) == fp32
    assert (fp32.stat().st_mtime_ns, int8.stat().st_mtime_ns) == stamps  # not exported again

    other = tmp_path / "model-copy"
    other.mkdir()
    for f in model_path().iterdir():
        os.symlink(f, other / f.name)
    os.unlink(other / "config.json")
    text = (
        (model_path() / "config.json")
        .read_text()
        .replace('"layer_norm_eps"', '"x": 1, "layer_norm_eps"')
    )
    (other / "config.json").write_text(text)
    assert model_digest(other) != model_digest(model_path())


def test_unknown_backend_and_gpu_onnx_are_refused() -> None:
    with pytest.raises(ValueError, match="embed_backend"):
        PredictorConfig(embed_backend="tensorrt")
    with pytest.raises(ValueError, match="CPU only"):
        Embedder(device="cuda", backend="onnx")
    with pytest.raises(ValueError, match="embed_cache_items"):
        PredictorConfig(embed_cache_items=-1)


def test_cache_serves_repeats_and_evicts_least_recent() -> None:
    # fp32: int8's activation scales are per batch, so a text's vector shifts a little with
    # the texts it is batched with, and the recomputation check below wants exact equality.
    emb = Embedder(device="cpu", backend="onnx", cache_items=2)
    a, b, c = "first prompt", "second prompt", "third prompt"
    va, vb = emb.encode([a, b])
    assert (emb.cache.stats().hits, emb.cache.stats().misses) == (0, 2)
    again = emb.encode([a, a])  # both rows served by the cache
    assert np.array_equal(again[0], va) and np.array_equal(again[1], va)
    assert emb.cache.stats().hits == 2
    emb.encode([c])  # evicts b, the least recently used (a was just read)
    stats = emb.cache.stats()
    assert (stats.hits, stats.misses, stats.items) == (2, 3, 2)
    assert emb.cached(a) is not None and emb.cached(b) is None
    assert np.allclose(emb.encode([b])[0], vb, atol=1e-5)  # recomputed, same vector
    assert emb.cache.stats().misses == 4
    with pytest.raises(ValueError):
        emb.cached(a)[0] = 0.0  # type: ignore[index]  # stored vectors are read-only

    off = Embedder(device="cpu", backend="onnx-int8", cache_items=0)
    off.encode([a])
    off.encode([a])
    assert off.cache.stats().hits == 0 and off.cache.stats().items == 0


async def test_async_cache_hit_skips_the_model() -> None:
    emb = Embedder(device="cpu", backend="onnx-int8", cache_items=16)
    async with AsyncEmbedder(emb, max_batch_items=8, max_wait_ms=1) as front:
        first = await front.embed("a templated prompt")
        batches = front.batches
        repeats = await asyncio.gather(*(front.embed("a templated prompt") for _ in range(5)))
        assert front.batches == batches  # no model call for the repeats
    assert all(np.array_equal(v, first) for v in repeats)
    assert emb.cache.stats().hits == 5 and emb.cache.stats().misses == 1


@pytest.mark.slow
def test_export_on_first_start_never_touches_the_network(tmp_path: Path) -> None:
    """A fresh interpreter with an empty export cache, no Hugging Face variables set and every
    non-loopback connect or name lookup failing (and recorded) exports, loads and embeds."""
    child = Path(__file__).with_name("offline_child.py")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    env |= {"SAGESCHED_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, str(child), "--export"],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["guard_ok"] is True and report["blocked"] == []
    assert report["backend"] == "onnx-int8"
    assert {"model-fp32.onnx", "model-int8.onnx"} <= set(report["files"])
    assert abs(report["norm"] - 1.0) < 1e-4
