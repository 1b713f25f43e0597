"""`sagesched predictor`: build datasets, evaluate, and warm the output-length predictor."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

from predictor.config import PredictorConfig

DEFAULT_N_TRAIN = 8_000
DEFAULT_N_TEST = 1_000


def _config(overrides: list[str]) -> PredictorConfig:
    """Defaults with `key=value` overrides (values parsed as JSON, else kept as text)."""
    types = {f.name for f in fields(PredictorConfig)}
    data: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or key not in types:
            raise SystemExit(f"bad --set {item!r}; known keys: {', '.join(sorted(types))}")
        try:
            data[key] = json.loads(raw)
        except json.JSONDecodeError:
            data[key] = raw
    return PredictorConfig.from_dict(data)


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    ev = sub.add_parser("eval", help="score the semantic predictor against two baselines")
    ev.add_argument("--train", required=True, type=Path, help="JSONL {prompt, output_tokens}")
    ev.add_argument("--test", required=True, type=Path, help="JSONL {prompt, output_tokens}")
    ev.add_argument("--json", action="store_true", help="machine-readable output")
    ev.add_argument(
        "--cv-folds",
        type=int,
        default=5,
        help="choose settings by k-fold CV on --train only (0: use the config as given)",
    )
    ev.add_argument(
        "--cache-dir",
        type=Path,
        default=Path(".cache/predictor"),
        help="embeddings cache (an .npz per file and clip setting)",
    )
    ev.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a PredictorConfig field (repeatable)",
    )
    bd = sub.add_parser("build-dataset", help="write train/test JSONL from the shared prompts")
    bd.add_argument("--source", choices=("sharegpt", "alpaca", "mt_bench"), default="sharegpt")
    bd.add_argument("--train-out", required=True, type=Path)
    bd.add_argument("--test-out", required=True, type=Path)
    bd.add_argument("--n-train", type=int, default=DEFAULT_N_TRAIN)
    bd.add_argument("--n-test", type=int, default=DEFAULT_N_TEST)
    bd.add_argument("--seed", type=int, default=0)
    bd.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="shared data folder (default: $SAGESCHED_SHARED_DATA or ../shared/data)",
    )
    wm = sub.add_parser("warm", help="learn a JSONL file and save a history snapshot")
    wm.add_argument("--from", dest="source", required=True, type=Path)
    wm.add_argument("--out", required=True, type=Path, help="snapshot file to write")
    wm.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    wm.add_argument(
        "--model", default=None, help="learn into this served model's own state (default: shared)"
    )
    return parser


def _eval(args: argparse.Namespace) -> int:
    from predictor.evaluate import (
        GlobalBaseline,
        LengthRegressionBaseline,
        Predictor,
        SemanticPredictor,
        cached_embeddings,
        evaluate,
        fill_prompt_tokens,
    )
    from predictor.model import LengthPredictor, read_jsonl
    from predictor.tuning import cross_validate

    config = _config(args.set)
    model = LengthPredictor(config)
    train, test = list(read_jsonl(args.train)), list(read_jsonl(args.test))
    for records in (train, test):
        fill_prompt_tokens(model, records)
    chosen: dict[str, Any] = {}
    if args.cv_folds > 1:
        vectors = cached_embeddings(model, [r["prompt"] for r in train], args.cache_dir)
        base = config.to_dict()
        config, _ = cross_validate(model, train, vectors, folds=args.cv_folds)
        chosen = {k: v for k, v in config.to_dict().items() if v != base[k]}
        model = LengthPredictor(config, embedder=model.embedder)
    predictors: list[Predictor] = [
        SemanticPredictor(model, args.cache_dir),
        GlobalBaseline(config.bucket_count),
        LengthRegressionBaseline(config.bucket_count),
    ]
    results = evaluate(predictors, train, test)
    if args.json:
        out = {"results": results, "chosen_by_cv": chosen, "config": config.to_dict()}
        print(json.dumps(out, indent=2, sort_keys=True))
        return 0
    print(f"train {len(train)} / test {len(test)} records; chosen by {args.cv_folds}-fold CV "
          f"on train (changed settings): {chosen}")  # fmt: skip
    cols = ["kendall_tau", "kendall_tau_median", "kendall_tau_mean", "mae_median"]
    cols += ["coverage_10_90", "spearman", "pinball_0.5", "predict_ms_per_item"]
    print(f"{'predictor':<18}" + "".join(f"{c:>19}" for c in cols))
    for name, row in results.items():
        print(f"{name:<18}" + "".join(f"{row[c]:>19.3f}" for c in cols))
    glob = results["global"]["mae_median"]
    sem = results["semantic"]
    print(
        f"semantic MAE of the median vs global: {100 * (sem['mae_median'] / glob - 1):+.1f}%; "
        f"ltr ranking score tau: {sem.get('kendall_tau_rank_score', float('nan')):.3f}"
    )
    return 0


def _build(args: argparse.Namespace) -> int:
    from predictor.datasets import build_split

    n_train, n_test = build_split(
        args.source,
        args.n_train,
        args.n_test,
        args.train_out,
        args.test_out,
        seed=args.seed,
        data_dir=args.data_dir,
    )
    print(f"wrote {n_train} records to {args.train_out} and {n_test} to {args.test_out}")
    return 0


def _warm(args: argparse.Namespace) -> int:
    from predictor.model import LengthPredictor

    model = LengthPredictor(_config(args.set))
    added = model.warm_start(args.source, model=args.model)
    model.save(args.out)
    print(f"learned {added} records; snapshot written to {args.out}")
    return 0


def main(argv: list[str], prog: str = "sagesched predictor") -> int:
    args = _parser(prog).parse_args(argv)
    handlers = {"eval": _eval, "build-dataset": _build, "warm": _warm}
    try:
        return handlers[args.command](args)
    except (OSError, ValueError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
