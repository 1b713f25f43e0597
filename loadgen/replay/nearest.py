"""`--prompts nearest`: replay a capture with the shipped prompts nearest to its prompts.

A capture made with `capture.embeddings` on holds each prompt's MiniLM embedding (never its
text). For each captured request with one, the replay sends the shipped prompt
(`loadgen/data/prompts`, `prompts.SAMPLE_PATH`) whose embedding has the highest cosine
similarity with it, so the gateway's semantic predictor reads text of the same kind as the
operator's; a request without an embedding gets synthetic token ids of its recorded prompt
length. Output lengths stay the recorded ones (`max_tokens` + `ignore_eos`, as every replay).

The shipped prompts are embedded the way the gateway embeds a `/v1/completions` prompt
(`predictor.request_text`, then the predictor's clipping, the default `PredictorConfig`
embedder: MiniLM through ONNX int8), offline, once per machine: the vectors are cached under
`$SAGESCHED_CACHE_DIR/prompt-embeddings`, else `$XDG_CACHE_HOME/sagesched/…`, else
`~/.cache/sagesched/…`, keyed by the model folder, the backend and every embedded text.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from loadgen.replay.client import ReplayRequest
from loadgen.replay.prompts import PromptRow, load_prompt_rows, row_requests
from loadgen.schema import TraceRequest
from predictor import Embedder, PredictorConfig, clip_text, model_path, request_text

Vectors = NDArray[np.float32]


@dataclass(frozen=True, slots=True)
class NearestPrompts:
    """The shipped prompts and their embeddings (rows L2-normalised, one per prompt)."""

    rows: tuple[PromptRow, ...]
    vectors: Vectors

    def nearest(self, vectors: Sequence[Vectors | None]) -> list[PromptRow | None]:
        """For each vector, the prompt with the highest cosine similarity (None for None)."""
        out: list[PromptRow | None] = [None] * len(vectors)
        have = [i for i, v in enumerate(vectors) if v is not None]
        if not have:
            return out
        q = np.stack([np.asarray(vectors[i], dtype=np.float32) for i in have])
        if q.shape[1] != self.vectors.shape[1]:
            raise ValueError(
                f"captured embeddings have {q.shape[1]} dimensions, the shipped prompts' "
                f"{self.vectors.shape[1]}: the capture was made with another embedding model"
            )
        best = np.argmax(_normalised(q) @ self.vectors.T, axis=1)
        for i, b in zip(have, best, strict=True):
            out[i] = self.rows[int(b)]
        return out


def embedded_text(prompt: str, config: PredictorConfig) -> str:
    """The text the gateway's predictor embeds for `prompt` sent to `/v1/completions`."""
    return clip_text(
        request_text({"prompt": prompt}), config.embed_max_chars, config.embed_head_fraction
    )


def shipped_prompts(
    rows: Sequence[PromptRow] | None = None,
    *,
    embedder: Embedder | None = None,
    cache_dir: Path | None = None,
) -> NearestPrompts:
    """The shipped prompts (or `rows`) with their embeddings, from the cache when an earlier
    run stored them; otherwise embedded now (about 2 s for the 400 shipped prompts) with
    `embedder` (default: the default `PredictorConfig`'s, loaded only on a cache miss)."""
    config = PredictorConfig()
    rows = tuple(load_prompt_rows("sample") if rows is None else rows)
    texts = [embedded_text(r.prompt, config) for r in rows]
    backend = embedder.backend if embedder is not None else config.embed_backend
    folder = embedder.path if embedder is not None else model_path()
    digest = hashlib.sha256(f"{folder.name}\0{backend}".encode())
    for t in texts:
        digest.update(hashlib.sha256(t.encode()).digest())
    path = (cache_dir or default_cache_dir()) / f"prompts-{digest.hexdigest()[:24]}.npy"
    if path.exists():
        vectors = np.load(path).astype(np.float32)
    else:
        model = embedder if embedder is not None else Embedder.from_config(config)
        vectors = _normalised(model.encode(texts))
        _save(path, vectors)
    return NearestPrompts(rows, vectors)


def nearest_requests(
    trace: Sequence[TraceRequest],
    embeddings: Sequence[Vectors | None],
    prompts: NearestPrompts,
    *,
    seed: int = 0,
    count_tokens: Callable[[str], int] | None = None,
    max_output: int | None = None,
    pad: bool = False,
) -> tuple[list[ReplayRequest], int]:
    """Replay requests for `trace` (a capture's requests, `embeddings[i]` the i-th one's or
    None): the nearest shipped prompt where there is an embedding, synthetic token ids of the
    recorded prompt length where there is none. Also returns how many fell back."""
    if len(trace) != len(embeddings):
        raise ValueError(f"{len(trace)} requests but {len(embeddings)} embeddings")
    rows = prompts.nearest(embeddings)
    reqs = row_requests(trace, rows, seed=seed, count_tokens=count_tokens,
                        max_output=max_output, pad=pad)  # fmt: skip
    return reqs, sum(1 for r in rows if r is None)


def default_cache_dir() -> Path:
    """Where the shipped prompts' embeddings are cached: beside the predictor's ONNX exports,
    in the one cache folder the predictor resolves (`predictor.onnx_export.default_cache_dir`
    is its `onnx` subfolder)."""
    from predictor.onnx_export import default_cache_dir as onnx_cache_dir

    return onnx_cache_dir().parent / "prompt-embeddings"


def _normalised(vectors: Vectors) -> Vectors:
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    out: Vectors = (vectors / np.maximum(norms, 1e-12)).astype(np.float32)
    return out


def _save(path: Path, vectors: Vectors) -> None:
    """Write atomically (two replays at once leave one whole file); a cache that cannot be
    written is skipped."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.npy")
        np.save(tmp, vectors)
        os.replace(tmp, path)
    except OSError:
        pass
