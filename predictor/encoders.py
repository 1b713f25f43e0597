"""The model backends behind `Embedder`: text → L2-normalised MiniLM sentence embeddings.

Contract (`Encoder`): `encode(texts, batch_size)` returns float32 (len(texts), dim), rows in
the order given; it is called under the `Embedder`'s lock (one call at a time). Catalog, by
the name `PredictorConfig.embed_backend` uses:

- `torch`: sentence-transformers on torch, the reference (and the GPU path).
- `onnx`: the same module stack exported to ONNX (fp32), run by onnxruntime on the CPU.
- `onnx-int8`: that export with int8 MatMul weights (dynamic quantization), the default.

The ONNX backends tokenize with the model folder's own `tokenizer.json` (the Rust tokenizer
sentence-transformers' fast tokenizer wraps), truncated to the model's `max_seq_length`
(longest first) and padded to the longest text of each forward pass, as sentence-transformers
does; a test pins the token ids to sentence-transformers' own. They never import torch unless
the export is missing (`predictor.onnx_export`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from numpy.typing import NDArray

from predictor.offline import ModelNotFoundError, force_offline

Embeddings = NDArray[np.float32]
"""Rows of unit-length sentence embeddings."""


class Encoder(Protocol):
    """A model backend. `device` is where it runs ("cpu", "cuda")."""

    name: str
    dim: int
    device: str

    def encode(self, texts: Sequence[str], batch_size: int) -> Embeddings:
        """Embeddings of `texts` in order, forward passes of at most `batch_size` rows."""
        ...


EncoderFactory = Callable[..., Encoder]
ENCODERS: dict[str, EncoderFactory] = {}


def register(name: str) -> Callable[[EncoderFactory], EncoderFactory]:
    """Register an encoder factory under `name` (loud on duplicates)."""

    def deco(factory: EncoderFactory) -> EncoderFactory:
        if name in ENCODERS:
            raise ValueError(f"encoder {name!r} registered twice")
        ENCODERS[name] = factory
        return factory

    return deco


def make_encoder(
    name: str, folder: Path, *, device: str | None, threads: int, cache_dir: str | None
) -> Encoder:
    """Build the encoder registered as `name` on the model folder `folder`. `threads` > 0 sets
    the intra-op threads (torch: process-wide)."""
    if name not in ENCODERS:
        raise ValueError(f"unknown embed backend {name!r}; known: {sorted(ENCODERS)}")
    return ENCODERS[name](folder, device=device, threads=threads, cache_dir=cache_dir)


class TorchEncoder:
    """sentence-transformers on torch: the reference path. Imports torch (~5 s once)."""

    name = "torch"

    def __init__(self, folder: Path, device: str | None, threads: int) -> None:
        force_offline()
        import torch
        from sentence_transformers import SentenceTransformer

        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if threads > 0 and self.device == "cpu":
            torch.set_num_threads(threads)
        try:
            self.model = SentenceTransformer(str(folder), device=self.device)
        except OSError as exc:  # e.g. a corrupt file: still never a download
            raise ModelNotFoundError(f"cannot load embedding model from {folder}: {exc}") from exc
        dim = self.model.get_embedding_dimension()
        if dim is None:
            raise ModelNotFoundError(f"{folder} does not declare an embedding dimension")
        self.dim = int(dim)

    def encode(self, texts: Sequence[str], batch_size: int) -> Embeddings:
        out = self.model.encode(
            list(texts),
            batch_size=batch_size,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=False,
        )
        return np.ascontiguousarray(out, dtype=np.float32)


@register("torch")
def _torch(folder: Path, *, device: str | None, threads: int, cache_dir: str | None) -> Encoder:
    return TorchEncoder(folder, device, threads)


def max_seq_length(folder: Path) -> int:
    """Word pieces sentence-transformers feeds the model: `max_seq_length` of
    sentence_bert_config.json (else the tokenizer's), capped by the position embeddings."""
    config = json.loads((folder / "config.json").read_text())
    st_file = folder / "sentence_bert_config.json"
    st_config = json.loads(st_file.read_text()) if st_file.is_file() else {}
    tok_file = folder / "tokenizer_config.json"
    tok_config = json.loads(tok_file.read_text()) if tok_file.is_file() else {}
    length = st_config.get("max_seq_length") or tok_config.get("model_max_length") or 512
    return int(min(length, config.get("max_position_embeddings", length)))


def declared_dim(folder: Path) -> int:
    """The sentence-embedding size the model folder declares, without loading the model: the
    last Dense module's `out_features`, else its Pooling module's output (the word embedding
    size once per pooling mode), else config.json's `hidden_size`. `Embedder` checks it
    against the model when it loads."""
    modules_file = folder / "modules.json"
    modules = json.loads(modules_file.read_text()) if modules_file.is_file() else []
    dim = int(json.loads((folder / "config.json").read_text())["hidden_size"])
    for module in modules:
        kind, config_file = module.get("type", ""), folder / module.get("path", "") / "config.json"
        if not module.get("path") or not config_file.is_file():
            continue
        config = json.loads(config_file.read_text())
        if kind.endswith("Pooling"):
            modes = [k for k, on in config.items() if k.startswith("pooling_mode_") and on is True]
            dim = int(config.get("word_embedding_dimension", dim)) * max(len(modes), 1)
        elif kind.endswith("Dense"):
            dim = int(config["out_features"])
    return dim


class OnnxEncoder:
    """The exported stack on onnxruntime's CPU provider; fp32 or int8."""

    def __init__(self, folder: Path, precision: str, threads: int, cache_dir: str | None) -> None:
        import onnxruntime as ort
        from tokenizers import Tokenizer

        from predictor.onnx_export import INPUT_NAMES, onnx_file

        self.name = "onnx" if precision == "fp32" else f"onnx-{precision}"
        self.device = "cpu"
        # int8 quantizes activations with one scale per tensor, computed at run time over the
        # whole pass: batched with other texts, a text would get a slightly different vector
        # (cosine ~0.999) than alone. One row per pass keeps each vector a function of its
        # text alone (the cache and a restart agree); it costs little, since int8 is cheap
        # per row and long prompts gain nothing from batching (docs/benchmarks.md).
        self.rows_per_pass = 1 if precision == "int8" else None
        self.file = onnx_file(precision, folder, cache_dir)
        self.max_tokens = max_seq_length(folder)
        tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        tok.no_padding()  # padded per forward pass below, to that pass's longest text
        tok.enable_truncation(self.max_tokens, strategy="longest_first")
        self._tokenizer = tok
        pad = tok.token_to_id("[PAD]")
        self._pad_id = 0 if pad is None else int(pad)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = max(threads, 0)  # 0: onnxruntime's default (one per core)
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        # Idle worker threads would spin on a shared 2-core box and steal the event loop's core.
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self._session = ort.InferenceSession(
            str(self.file), opts, providers=["CPUExecutionProvider"]
        )
        self._inputs = [i.name for i in self._session.get_inputs()]
        if set(self._inputs) - set(INPUT_NAMES):
            raise ModelNotFoundError(f"{self.file} has unexpected inputs {self._inputs}")
        self.dim = int(self._session.get_outputs()[0].shape[-1])

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Word-piece ids of each text with [CLS]/[SEP], truncated as the model reads them."""
        return [enc.ids for enc in self._tokenizer.encode_batch(list(texts))]

    def encode(self, texts: Sequence[str], batch_size: int) -> Embeddings:
        ids = self.tokenize(texts)
        batch_size = min(batch_size, self.rows_per_pass or batch_size)
        order = np.argsort([len(x) for x in ids], kind="stable")  # short with short: less padding
        out = np.empty((len(ids), self.dim), dtype=np.float32)
        for start in range(0, len(order), batch_size):
            rows = order[start : start + batch_size]
            out[rows] = self._run([ids[i] for i in rows])
        return out

    def _run(self, ids: list[list[int]]) -> NDArray[np.float32]:
        width = max(len(x) for x in ids)
        input_ids = np.full((len(ids), width), self._pad_id, dtype=np.int64)
        mask = np.zeros((len(ids), width), dtype=np.int64)
        for row, x in enumerate(ids):
            input_ids[row, : len(x)] = x
            mask[row, : len(x)] = 1
        feeds: dict[str, Any] = {
            "input_ids": input_ids,
            "attention_mask": mask,
            "token_type_ids": np.zeros_like(input_ids),
        }
        (vecs,) = self._session.run(None, {k: feeds[k] for k in self._inputs})
        return np.asarray(vecs, dtype=np.float32)


def _cpu_only(name: str, device: str | None) -> None:
    if device not in (None, "cpu"):
        raise ValueError(f"embed backend {name!r} runs on the CPU only, not {device!r}")


@register("onnx")
def _onnx(folder: Path, *, device: str | None, threads: int, cache_dir: str | None) -> Encoder:
    _cpu_only("onnx", device)
    return OnnxEncoder(folder, "fp32", threads, cache_dir)


@register("onnx-int8")
def _onnx_int8(folder: Path, *, device: str | None, threads: int, cache_dir: str | None) -> Encoder:
    _cpu_only("onnx-int8", device)
    return OnnxEncoder(folder, "int8", threads, cache_dir)
