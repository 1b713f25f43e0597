"""A static embedding against the shipped MiniLM int8: ranking quality and CPU per prompt.

    python bench/static_embedding.py --static DIR [--data .cache/pred] [--prompts 200]

`DIR` is a model2vec static model distilled from the bundled MiniLM (each vocabulary token
embedded once by MiniLM, reduced by PCA; a sentence is then the weighted mean of its tokens'
rows, no forward pass). model2vec's distillation pins transformers below the version this
project locks, so distil in a separate environment (the project's own needs only the
`model2vec` package, without extras, to read the folder):

    python -m venv /tmp/m2v && /tmp/m2v/bin/pip install torch "model2vec[distill,quantization]"
    MINILM=$(.venv/bin/python -c "from predictor.offline import model_path; print(model_path())")
    HF_HUB_OFFLINE=1 /tmp/m2v/bin/python -c "import sys; from model2vec.distill import distill; \
        distill(model_name=sys.argv[1], pca_dims=256).save_pretrained(sys.argv[2])" $MINILM DIR

For each prompt set of `--data` (SET-train.jsonl / SET-test.jsonl as `sagesched predictor
build-dataset` writes them; MT-Bench is predicted from the ShareGPT history), the predictor
learns the train file and scores the test file with its shipped settings (no CV), once per
embedder; printed: Kendall τ of SageSched's admission key and of the rank score against the
true length, MAE of the median, and the embedder's CPU time per prompt (one prompt per call,
as the gateway embeds a new prompt; `--prompts` distinct test prompts, cache off).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from predictor import Embedder, LengthPredictor, PredictorConfig  # noqa: E402
from predictor.encoders import Embeddings, register  # noqa: E402
from predictor.evaluate import SemanticPredictor, evaluate, fill_prompt_tokens  # noqa: E402
from predictor.model import read_jsonl  # noqa: E402

SETS = {"sharegpt": ("sharegpt", "sharegpt"), "alpaca": ("alpaca", "alpaca"),
        "mt_bench": ("sharegpt", "mt_bench")}  # fmt: skip
"""Set → (its train file's set, its test file's set)."""
STATIC = "model2vec-bench"


class StaticEncoder:
    """A model2vec static model as an `Encoder` (rows L2-normalised as MiniLM's are)."""

    name, device = STATIC, "cpu"

    def __init__(self, folder: str) -> None:
        from model2vec import StaticModel

        self._model = StaticModel.from_pretrained(folder)
        self.dim = int(self._model.dim)

    def encode(self, texts: Any, batch_size: int) -> Embeddings:
        vecs = np.asarray(self._model.encode(list(texts), show_progress_bar=False), np.float32)
        out: Embeddings = vecs / np.maximum(np.linalg.norm(vecs, axis=1, keepdims=True), 1e-12)
        return out


def cpu_ms_per_prompt(embedder: Embedder, prompts: list[str]) -> float:
    """Process CPU time of embedding each prompt alone (after a short warm-up)."""
    for p in prompts[:10]:
        embedder.encode([p + " warm-up"])
    t0 = time.process_time()
    for p in prompts:
        embedder.encode([p])
    return (time.process_time() - t0) * 1000 / len(prompts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--static", required=True, help="a model2vec folder distilled from MiniLM")
    ap.add_argument("--data", default=str(ROOT / ".cache/pred"))
    ap.add_argument("--sets", default=",".join(SETS))
    ap.add_argument("--prompts", type=int, default=200)
    args = ap.parse_args()
    register(STATIC)(lambda folder, **_: StaticEncoder(args.static))
    names = ("onnx-int8", STATIC)
    embedders = {n: Embedder(backend=n, torch_threads=1, cache_items=0) for n in names}
    print("| set | embedder | τ admission key | τ rank score | MAE (tokens) | CPU ms/prompt |")
    print("|---|---|---:|---:|---:|---:|")
    for s in args.sets.split(","):
        train_set, test_set = SETS[s]
        train = list(read_jsonl(Path(args.data) / f"{train_set}-train.jsonl"))
        test = list(read_jsonl(Path(args.data) / f"{test_set}-test.jsonl"))
        for name, embedder in embedders.items():
            model = LengthPredictor(PredictorConfig(embed_backend=name), embedder=embedder)
            for records in (train, test):
                fill_prompt_tokens(model, records)  # once: the second embedder finds them all
            row = evaluate([SemanticPredictor(model)], train, test)["semantic"]
            prompts = [model.text(r["prompt"]) for r in test[: args.prompts]]
            cpu = cpu_ms_per_prompt(embedder, prompts)
            label = "MiniLM onnx-int8 (shipped)" if name == "onnx-int8" else "static (model2vec)"
            print(f"| {s} | {label} | {row['kendall_tau']:.3f} | "
                  f"{row['kendall_tau_rank_score']:.3f} | {row['mae_median']:.1f} | {cpu:.3f} |",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
