"""Export the bundled MiniLM to ONNX (fp32 and int8), locally, once, into a cache folder.

The graph is the whole sentence-transformers module stack of the model folder (Transformer,
Pooling, Normalize, as its `modules.json` lists them), traced from the same weights the
PyTorch path loads, so the ONNX model returns the very L2-normalised sentence embedding
sentence-transformers computes: inputs `input_ids`, `attention_mask`, `token_type_ids` (int64,
batch × tokens), output `sentence_embedding` (float32, batch × 384).

Files live in `<cache>/<model folder name>-<digest>/model-{fp32,int8}.onnx`, where the digest
hashes the model files the graph depends on plus `EXPORT_RECIPE`: new weights or a new recipe
get a new folder, never a stale graph. The cache is `PredictorConfig.onnx_cache_dir`, else
`$SAGESCHED_CACHE_DIR/onnx`, else `$XDG_CACHE_HOME/sagesched/onnx`, else
`~/.cache/sagesched/onnx`. Each file is written to a temporary name in its folder, fsynced and
renamed, so a crash or two processes exporting at once leave either no file or a whole one.

Nothing here touches the network: the weights come from `predictor.offline.model_path()`,
the Hugging Face libraries are switched offline first. Exporting needs torch,
sentence-transformers, onnx and onnxruntime's quantizer (~10 s on one core); loading an
exported file needs only onnxruntime. `python -m predictor.onnx_export` exports ahead of time
(the Makefile does it at install); otherwise the first `Embedder` with an ONNX backend does.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from predictor.offline import force_offline, model_path

EXPORT_RECIPE = "st-stack/opset17/eager-attention/int8-dynamic-per-channel-matmul-v2"
"""Changes whenever the export or quantization steps change (it is part of the cache key)."""

OPSET = 17
INPUT_NAMES = ("input_ids", "attention_mask", "token_type_ids")
OUTPUT_NAME = "sentence_embedding"
PRECISIONS = ("fp32", "int8")

# The files the exported graph depends on (the tokenizer runs outside the graph).
_GRAPH_FILES = ("model.safetensors", "config.json", "modules.json", "1_Pooling/config.json")

log = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    """Where exported models go when the config names no folder."""
    if base := os.environ.get("SAGESCHED_CACHE_DIR"):
        return Path(base) / "onnx"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "sagesched" / "onnx"


def model_digest(folder: Path) -> str:
    """First 16 hex digits of a BLAKE2b over the graph's model files and `EXPORT_RECIPE`."""
    h = hashlib.blake2b(EXPORT_RECIPE.encode(), digest_size=16)
    for name in _GRAPH_FILES:
        path = folder / name
        if not path.is_file():
            continue  # model_path() already checked the required ones
        h.update(name.encode())
        with path.open("rb") as f:
            h.update(hashlib.file_digest(f, "blake2b").digest())
    return h.hexdigest()[:16]


def onnx_file(
    precision: str,
    path: str | os.PathLike[str] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> Path:
    """The exported model of the given precision ("fp32" or "int8"), exporting it first when
    it is not in the cache yet. Blocking (seconds when it exports)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, not {precision!r}")
    folder = model_path(path)
    target_dir = Path(cache_dir) if cache_dir else default_cache_dir()
    target_dir = target_dir / f"{folder.name}-{model_digest(folder)}"
    target = target_dir / f"model-{precision}.onnx"
    if target.is_file():
        return target
    target_dir.mkdir(parents=True, exist_ok=True)
    fp32 = target_dir / "model-fp32.onnx"
    if not fp32.is_file():
        log.info("exporting %s to ONNX in %s (once per model)", folder, target_dir)
        with _atomic(fp32) as tmp:
            export_fp32(folder, tmp)
    if precision == "int8":
        with _atomic(target) as tmp:
            quantize_int8(fp32, tmp)
    return target


def export_fp32(folder: Path, out: Path) -> None:
    """Trace the sentence-transformers stack of `folder` into an fp32 ONNX file `out`."""
    force_offline()
    import torch
    from sentence_transformers import SentenceTransformer

    # Eager attention traces into plain MatMul/Softmax, which onnxruntime fuses and quantizes;
    # the SDPA path would trace into a graph the quantizer and fusions understand less well.
    st = SentenceTransformer(
        str(folder), device="cpu", model_kwargs={"attn_implementation": "eager"}
    ).eval()

    class Stack(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.st = st

        def forward(self, ids: Any, mask: Any, types: Any) -> Any:
            feats = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
            return self.st(feats)["sentence_embedding"]

    texts = ["a sample sentence", "and a longer sample sentence to trace"]
    sample = st.tokenizer(texts, padding=True, return_tensors="pt")
    args = tuple(sample[name] for name in INPUT_NAMES)
    axes = {name: {0: "batch", 1: "tokens"} for name in INPUT_NAMES}
    with warnings.catch_warnings(), torch.no_grad():
        # The TorchScript exporter warns that it is legacy, and the tracer warns about Python
        # branches on shapes (the padding checks of masking and pooling, constant for our
        # inputs); the cosine test against the PyTorch path is what proves the graph.
        warnings.simplefilter("ignore")
        torch.onnx.export(
            Stack().eval(),
            args,
            str(out),
            input_names=list(INPUT_NAMES),
            output_names=[OUTPUT_NAME],
            dynamic_axes=axes | {OUTPUT_NAME: {0: "batch"}},
            opset_version=OPSET,
            dynamo=False,
        )


def quantize_int8(fp32: Path, out: Path) -> None:
    """Dynamic int8 quantization of MatMul weights (per output channel; activations quantized
    at run time per tensor). Kept fp32: embeddings, LayerNorm, softmax, pooling, and the
    MatMuls `fp32_matmuls` picks, where int8 cost the most agreement with the PyTorch path."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    keep = fp32_matmuls(onnx.load(str(fp32), load_external_data=False))
    quant_log = logging.getLogger()  # the quantizer advises pre-processing on the root logger
    level = quant_log.level
    quant_log.setLevel(logging.ERROR)
    try:
        quantize_dynamic(
            fp32,
            out,
            weight_type=QuantType.QInt8,
            per_channel=True,
            op_types_to_quantize=["MatMul"],
            nodes_to_exclude=keep,
            extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT},
        )
    finally:
        quant_log.setLevel(level)


def fp32_matmuls(model: Any) -> list[str]:
    """MatMul nodes left in fp32: each layer's feed-forward output projection (its input, after
    GELU, has the outliers that per-tensor activation scales handle worst) and all of the first
    layer. On 300 ShareGPT prompts this raised the worst cosine to the PyTorch path from 0.977
    (everything int8) to 0.990 (docs/benchmarks.md, "ONNX embedder")."""
    names = [n.name for n in model.graph.node if n.op_type == "MatMul"]
    ffn_out = [n for n in names if "/output/dense/" in n and "/attention/" not in n]
    first = [n for n in names if "/layer.0/" in n]
    return sorted(set(ffn_out + first))


@contextlib.contextmanager
def _atomic(target: Path) -> Iterator[Path]:
    """A temporary path next to `target`; renamed over it (after fsync) if the body succeeds."""
    fd, name = tempfile.mkstemp(prefix=f".{target.stem}-", suffix=".onnx", dir=target.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o666 & ~umask)  # as a plain open() would create it, not mkstemp's 0600
        with tmp.open("rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, target)
        dir_fd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    finally:
        tmp.unlink(missing_ok=True)


def main() -> int:
    """Export both precisions ahead of time (install step); prints their paths."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for precision in PRECISIONS:
        print(onnx_file(precision))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
