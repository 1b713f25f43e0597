"""The semantic output-length predictor: prompt → `policies.LengthDist` of output tokens.

Parts: `Embedder`/`AsyncEmbedder` (MiniLM sentence embeddings, offline, micro-batched off the
event loop), `HistoryIndex` (hnswlib cosine k-NN over completed requests, a bounded ring),
`LengthPredictor` (neighbours → weighted length distribution blended with the global one;
learns from `observe`; atomic snapshots), `request_text` (what of a request is embedded), and
offline evaluation against baselines (`predictor.evaluate`, `sagesched predictor eval`).

Dependency rule: imports `policies` (for `LengthDist`), numpy and third-party libraries, never
`gateway` or `loadgen`. torch, sentence-transformers, transformers, hnswlib and scipy are
imported lazily, so `import predictor` stays cheap. To add a predictor to the evaluation,
implement the `predictor.evaluate.Predictor` protocol (`name`, `fit`, `predict`).
"""

from predictor.config import PredictorConfig
from predictor.embedder import AsyncEmbedder, Embedder, EmbedderClosedError
from predictor.history import HistoryIndex, Neighbours, SnapshotError
from predictor.model import LengthPredictor, blend, prior_dist, read_jsonl
from predictor.offline import (
    OFFLINE_ENV,
    ModelNotFoundError,
    force_offline,
    load_tokenizer,
    model_path,
)
from predictor.text import chat_text, clip_text, request_text

__all__ = [
    "OFFLINE_ENV",
    "AsyncEmbedder",
    "Embedder",
    "EmbedderClosedError",
    "HistoryIndex",
    "LengthPredictor",
    "ModelNotFoundError",
    "Neighbours",
    "PredictorConfig",
    "SnapshotError",
    "blend",
    "chat_text",
    "clip_text",
    "force_offline",
    "load_tokenizer",
    "model_path",
    "prior_dist",
    "read_jsonl",
    "request_text",
]
