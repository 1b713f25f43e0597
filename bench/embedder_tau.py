"""Does int8 keep the predictor's ranking? Kendall τ per embedding backend, same split.

    .venv/bin/python bench/embedder_tau.py [--sources sharegpt,alpaca] [--n-train 3000]
        [--n-test 1000] [--backends torch,onnx,onnx-int8]

For each source: one seeded train/test split (`predictor.datasets.build_records`), then for
each backend a fresh `LengthPredictor` (default config but `embed_backend`) learns the train
records online and predicts the test ones; prints τ of the scheduling key (the Gittins index at
zero attained service, `predictor.evaluate`), of the median and the mean, MAE of the median,
and the gap of each backend's τ to the torch reference. int8 is the default backend only if
that gap stays within 0.01 (docs/benchmarks.md, "ONNX embedder").
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

from predictor import Embedder, LengthPredictor, PredictorConfig, load_tokenizer  # noqa: E402
from predictor.datasets import build_records  # noqa: E402
from predictor.evaluate import SemanticPredictor, evaluate  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sources", default="sharegpt,alpaca")
    parser.add_argument("--n-train", type=int, default=3_000)
    parser.add_argument("--n-test", type=int, default=1_000)
    parser.add_argument("--backends", default="torch,onnx,onnx-int8")
    args = parser.parse_args()
    tokenizer = load_tokenizer()
    backends = args.backends.split(",")
    embedders = {b: Embedder(device="cpu", torch_threads=1, backend=b) for b in backends}
    print("| source | backend | τ (key) | τ (median) | τ (mean) | MAE median | Δτ vs torch "
          "| embed+predict ms/item |\n|---|---|---|---|---|---|---|---|")  # fmt: skip
    for source in args.sources.split(","):
        records = build_records(source, args.n_train + args.n_test, 0, tokenizer)
        test, train = records[: args.n_test], records[args.n_test :]
        ref: float | None = None
        for backend in backends:
            cfg = PredictorConfig(embed_backend=backend)
            model = LengthPredictor(cfg, embedder=embedders[backend])
            t = time.perf_counter()
            res = evaluate([SemanticPredictor(model)], train, test)["semantic"]
            tau = res["kendall_tau"]
            ref = tau if ref is None else ref
            print(
                f"| {source} | {backend} | {tau:.4f} | {res['kendall_tau_median']:.4f} "
                f"| {res['kendall_tau_mean']:.4f} | {res['mae_median']:.1f} | {tau - ref:+.4f} "
                f"| {res['predict_ms_per_item']:.1f} |",
                flush=True,
            )
            del t
    return 0


if __name__ == "__main__":
    sys.exit(main())
