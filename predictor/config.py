"""Typed configuration of the output-length predictor."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass(frozen=True, slots=True)
class PredictorConfig:
    """Every knob of the predictor, with its unit in the name.

    The blending defaults (k, temperature, global share, ridge weight, spread scale) were
    chosen by 5-fold cross-validation on the ShareGPT train file only (`sagesched predictor
    eval`, docs/benchmarks.md "Predictor"); the test files never informed them.
    `validate()` is called on construction, so an instance is always usable.
    """

    k_neighbours: int = 64
    """How many nearest neighbours one query asks the index for."""

    similarity_floor: float = 0.2
    """Cosine similarity below which a neighbour is ignored (1 = identical prompt)."""

    similarity_temperature: float = 0.1
    """Neighbour weight is exp((similarity − best similarity) / this); smaller = sharper."""

    prompt_length_scale_log: float = 1.0
    """Neighbours whose prompt length differs by a factor e^x lose weight exp(−x / this), so a
    pasted 3,000-token document is not answered like a one-line question on the same topic;
    0 switches this off."""

    min_neighbours: int = 8
    """With fewer usable neighbours than this, the prediction is blended with the global
    distribution in proportion to how many are missing (cold start works from request one)."""

    prior_weight: float = 0.8
    """Share g of the background that is always mixed in, even with many neighbours: the
    centre + the ridge's prequential residuals once it is trained, else the global
    distribution. A large share gives every prompt the same honest shape around its own
    centre, so the Gittins index orders by the centre (docs/benchmarks.md, ablation)."""

    bucket_count: int = 24
    """Support points of a predicted `LengthDist`: equal-mass quantiles of the blended
    samples (log-spaced buckets before version 2 lost order, see docs/predictor.md)."""

    ridge_weight: float = 0.3
    """Share of the online ridge regression (log length on the embedding) in the predicted
    centre; the rest is the neighbours' weighted mean log length. 0 = pure nearest
    neighbours. Falls back to the neighbours until the ridge has learned `min_neighbours`·4."""

    neighbour_spread_scale: float = 0.5
    """The neighbours' log lengths keep their spread around the centre times this (< 1
    sharpens, > 1 widens)."""

    ridge_l2: float = 1.0
    """Ridge penalty on the embedding weights."""

    model_min_items: int = 200
    """A served model's own history answers its predictions once it holds this many
    completions; until then the default history (warm start, requests without a model name,
    version-1 snapshots) answers. Learning always goes to the model's own history."""

    capacity_items: int = 100_000
    """History ring size: the oldest completed request is replaced beyond this."""

    global_window_items: int = 5_000
    """How many of the most recent completions form the global (fallback) distribution."""

    band_min_items: int = 50
    """The global distribution is conditioned on the prompt-length band (powers of two of
    prompt tokens) when that band holds at least this many recent items; otherwise all."""

    prior_median_tokens: float = 200.0
    """Median output length (tokens) of the built-in prior used before anything is learned."""

    hnsw_m: int = 16
    """hnswlib graph degree M."""

    hnsw_ef_construction: int = 100
    """hnswlib build-time candidate list size."""

    hnsw_ef_search: int = 64
    """hnswlib query-time candidate list size (raised to k when smaller)."""

    embed_max_chars: int = 512
    """Characters of prompt text handed to the embedder (about 120 word pieces of English;
    MiniLM could read 256). Embedding time grows with length, so this is the main speed
    knob; docs/benchmarks.md compares settings. Longer text is clipped, see `predictor.text`."""

    embed_head_fraction: float = 0.25
    """Share of `embed_max_chars` kept from the start of a clipped text; the rest is its end."""

    max_batch_items: int = 64
    """Most prompts the async embedder encodes in one model call."""

    encode_batch_items: int = 16
    """Rows per model forward pass. A micro-batch is sorted by length and cut into chunks of
    this size, so short prompts are not padded to the longest one; on ShareGPT prompts 4–16
    cost ~31 ms/prompt on a loaded 2-core CPU, 64 cost ~62 ms."""

    max_wait_ms: float = 2.0
    """How long the async embedder waits for more requests after the first one of a batch."""

    max_pending_items: int = 4_096
    """Bound of the async embedder's queue; protects memory when the model falls behind."""

    learn_wait_ms: float = 50.0
    """How long a completion `observe_async` learns waits for others, so that one trip to a
    worker thread learns them together."""

    embed_backend: str = "onnx-int8"
    """Embedding model backend (`predictor.encoders`): "onnx-int8" (onnxruntime on a local int8
    export; the default, ranks as well as fp32, docs/benchmarks.md "ONNX embedder"), "onnx"
    (fp32 export) or "torch" (sentence-transformers, the reference; the one that uses a GPU)."""

    embed_cache_items: int = 8_192
    """Most recent embeddings kept (LRU, keyed by a hash of the clipped text), so a repeated
    prompt skips the model; 1.5 KiB each. 0 disables the cache."""

    onnx_cache_dir: str | None = None
    """Folder of the ONNX exports (made on first start when missing); None: $SAGESCHED_CACHE_DIR
    /onnx, else ~/.cache/sagesched/onnx (`predictor.onnx_export`)."""

    torch_threads: int = 1
    """Intra-op threads of a CPU embedder, torch or onnxruntime (torch's are process-wide:
    `torch.set_num_threads`); 0 leaves the backend's default (one per core). One is the
    default because the gateway shares the CPU with its event loop and other processes, and
    the threads wait for each other when a core is taken away: on this 2-core box under load,
    batch-1 torch embedding took ~15 ms with one thread and ~200 ms with two
    (docs/benchmarks.md, "Predictor")."""

    device: str | None = None
    """Torch device for the embedder; None picks "cuda" when available, else "cpu"."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError on an out-of-range field."""
        positive = [
            "k_neighbours",
            "min_neighbours",
            "bucket_count",
            "capacity_items",
            "global_window_items",
            "hnsw_m",
            "hnsw_ef_construction",
            "hnsw_ef_search",
            "embed_max_chars",
            "max_batch_items",
            "encode_batch_items",
            "max_pending_items",
            "band_min_items",
            "model_min_items",
        ]
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if not -1.0 <= self.similarity_floor <= 1.0:
            raise ValueError("similarity_floor must be in [-1, 1]")
        if self.torch_threads < 0 or self.embed_cache_items < 0:
            raise ValueError("torch_threads and embed_cache_items must be >= 0")
        from predictor.encoders import ENCODERS  # the registry is the list of names

        if self.embed_backend not in ENCODERS:
            raise ValueError(f"embed_backend must be one of {sorted(ENCODERS)}")
        if self.prompt_length_scale_log < 0:
            raise ValueError("prompt_length_scale_log must be >= 0")
        if self.similarity_temperature <= 0:
            raise ValueError("similarity_temperature must be > 0")
        if not 0.0 <= self.ridge_weight <= 1.0:
            raise ValueError("ridge_weight must be in [0, 1]")
        if self.neighbour_spread_scale < 0 or self.ridge_l2 <= 0:
            raise ValueError("neighbour_spread_scale must be >= 0 and ridge_l2 > 0")
        if not 0.0 <= self.prior_weight < 1.0:
            raise ValueError("prior_weight must be in [0, 1)")
        if not 0.0 <= self.embed_head_fraction <= 1.0:
            raise ValueError("embed_head_fraction must be in [0, 1]")
        if self.max_wait_ms < 0 or self.learn_wait_ms < 0 or self.prior_median_tokens < 1:
            raise ValueError(
                "max_wait_ms and learn_wait_ms must be >= 0 and prior_median_tokens >= 1"
            )

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (for logs, JSON reports and snapshots)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PredictorConfig:
        """Inverse of `to_dict`; unknown keys are an error."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown predictor config keys: {unknown}")
        return cls(**data)
