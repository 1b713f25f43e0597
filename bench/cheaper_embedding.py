"""Cheaper embeddings against the shipped MiniLM int8: ranking quality and CPU per prompt.

    python bench/cheaper_embedding.py [--layers 2,3,4] [--static DIR] [--data .cache/pred]

Two ways to embed a prompt for less than the shipped forward pass, each learnt and scored by
the same predictor:

- `--layers K,...`: the bundled MiniLM cut to its first K transformer layers (of 6), exported
  and quantized exactly as the shipped int8 model (`predictor.onnx_export`), into a temporary
  folder. Mean pooling then reads layer K's token states; nothing is retrained.
- `--static DIR`: a model2vec static model distilled from the bundled MiniLM (each vocabulary
  token embedded once by MiniLM, reduced by PCA; a sentence is the weighted mean of its
  tokens' rows, no forward pass). model2vec's distillation pins transformers below the version
  this project locks, so distil in a separate environment (reading the folder needs only the
  `model2vec` package, without extras):

      python -m venv /tmp/m2v && /tmp/m2v/bin/pip install torch "model2vec[distill,quantization]"
      MINILM=$(.venv/bin/python -c "from predictor.offline import model_path; print(model_path())")
      HF_HUB_OFFLINE=1 /tmp/m2v/bin/python -c "import sys; from model2vec.distill import distill; \
          distill(model_name=sys.argv[1], pca_dims=256).save_pretrained(sys.argv[2])" $MINILM DIR

For each prompt set of `--data` (SET-train.jsonl / SET-test.jsonl as `sagesched predictor
build-dataset` writes them; MT-Bench, and Alpaca as `alpaca_from_sharegpt`, are predicted from
the ShareGPT history), the predictor learns the train file and scores the test file with its
shipped settings (no CV), once per embedder. Printed: Kendall τ of SageSched's admission key
and of the rank score against the true length, MAE of the median, the change of the admission
key's τ against the shipped embedder with its 95% interval (a paired bootstrap over the test
prompts, `--resamples`: the same resampled prompts score both embedders), and the embedder's
CPU time per prompt, one prompt per call as the gateway embeds a new prompt (`--prompts`
distinct test prompts, cache off) and for a short one-line question.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from predictor import Embedder, LengthPredictor, PredictorConfig  # noqa: E402
from predictor.encoders import Embeddings, register  # noqa: E402
from predictor.evaluate import (  # noqa: E402
    SemanticPredictor,
    fill_prompt_tokens,
    rank_corr,
    scheduling_key,
    score,
)
from predictor.model import read_jsonl  # noqa: E402
from predictor.offline import force_offline, model_path  # noqa: E402

SETS = {"sharegpt": ("sharegpt", "sharegpt"), "alpaca": ("alpaca", "alpaca"),
        "mt_bench": ("sharegpt", "mt_bench"),
        "alpaca_from_sharegpt": ("sharegpt", "alpaca")}  # fmt: skip
"""Set → (its train file's set, its test file's set). MT-Bench (60 test prompts) and Alpaca
predicted from the ShareGPT history (1,000) are prompts of another kind than the history's."""
STATIC = "model2vec-bench"
SHIPPED = "MiniLM onnx-int8, 6 layers (shipped)"
SHORT = [f"What is a good name for pet number {i} of mine?" for i in range(200)]


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


def first_layers(k: int, out: Path) -> Path:
    """The bundled MiniLM with only its first `k` transformer layers, saved to `out`."""
    force_offline()
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(model_path()), device="cpu")
    bert: Any = st[0].auto_model
    bert.encoder.layer = bert.encoder.layer[:k]
    bert.config.num_hidden_layers = k
    st.save(str(out))
    return out


def delta_interval(
    keys: np.ndarray, shipped: np.ndarray, truth: np.ndarray, resamples: int
) -> tuple[float, float]:
    """95% interval of τ(keys) − τ(shipped) over test prompts resampled with replacement."""
    rng = np.random.default_rng(0)
    deltas = []
    for _ in range(resamples):
        i = rng.integers(0, len(truth), len(truth))
        deltas.append(rank_corr("kendall", keys[i], truth[i])
                      - rank_corr("kendall", shipped[i], truth[i]))  # fmt: skip
    lo, hi = np.percentile(deltas, [2.5, 97.5])
    return float(lo), float(hi)


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
    ap.add_argument("--layers", default="", help="comma-separated layer counts to keep, e.g. 3,4")
    ap.add_argument("--static", default=None, help="a model2vec folder distilled from MiniLM")
    ap.add_argument("--data", default=str(ROOT / ".cache/pred"))
    ap.add_argument("--sets", default=",".join(SETS))
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--resamples", type=int, default=1000)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="cheaper-embedding-"))
    embedders = {SHIPPED: Embedder(backend="onnx-int8", torch_threads=1, cache_items=0)}
    for k in (int(x) for x in args.layers.split(",") if x):
        folder = first_layers(k, work / f"minilm-L{k}")
        embedders[f"MiniLM onnx-int8, first {k} layers"] = Embedder(
            folder, backend="onnx-int8", torch_threads=1, cache_items=0, onnx_cache_dir=str(work)
        )
    if args.static:
        register(STATIC)(lambda folder, **_: StaticEncoder(args.static))
        embedders["static (model2vec)"] = Embedder(backend=STATIC, cache_items=0)
    print("| set | test prompts | embedder | τ admission key | Δτ key [95% interval] "
          "| τ rank score | MAE (tokens) | CPU ms/prompt | CPU ms/short prompt |")  # fmt: skip
    print("|---|---:|---|---:|---|---:|---:|---:|---:|")
    for s in args.sets.split(","):
        train_set, test_set = SETS[s]
        train = list(read_jsonl(Path(args.data) / f"{train_set}-train.jsonl"))
        test = list(read_jsonl(Path(args.data) / f"{test_set}-test.jsonl"))
        truth = np.array([float(r["output_tokens"]) for r in test])
        shipped, shipped_tau = np.zeros(0), 0.0
        for n, (label, embedder) in enumerate(embedders.items()):
            model = LengthPredictor(PredictorConfig(), embedder=embedder)
            for records in (train, test):
                fill_prompt_tokens(model, records)  # once: later embedders find them all
            semantic = SemanticPredictor(model, cache_dir=work / f"vectors-{n}")
            semantic.fit(train)
            dists = semantic.predict(test)
            keys = np.array([scheduling_key(d) for d in dists])
            scored = score(dists, truth)
            tau, mae = scored["kendall_tau"], scored["mae_median"]
            rank_tau = rank_corr("kendall", np.asarray(semantic.rank_scores), truth)
            if label == SHIPPED:
                shipped, shipped_tau, delta = keys, tau, ""
            else:
                lo, hi = delta_interval(keys, shipped, truth, args.resamples)
                d = tau - shipped_tau
                delta = f"{d:+.3f} [{lo:+.3f}, {hi:+.3f}]"
            prompts = [model.text(r["prompt"]) for r in test[: args.prompts]]
            cpu, short = cpu_ms_per_prompt(embedder, prompts), cpu_ms_per_prompt(embedder, SHORT)
            print(f"| {s} | {len(test)} | {label} | {tau:.3f} | {delta} | {rank_tau:.3f} | "
                  f"{mae:.1f} | {cpu:.2f} | {short:.2f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
