"""Ablations of the semantic predictor on cached embeddings (docs/predictor.md, "Ablations").

    python -m bench.predictor_ablation --set sharegpt [--chars 512] [--folds 5]

Reads `.cache/pred/<set>-train.jsonl` / `-test.jsonl` (written by `sagesched predictor
build-dataset`) and their embeddings cached by `predictor.evaluate.cached_embeddings`. Neighbours
come from exact (brute-force) cosine search, so one experiment takes seconds; each variant is
scored by 5-fold cross-validation on the train file and then once on the test file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from policies import LengthDist
from predictor.config import PredictorConfig
from predictor.evaluate import score
from predictor.history import Neighbours
from predictor.learners import OnlineRidge, features
from predictor.model import blend, prompt_band

Blender = Callable[..., LengthDist]


def legacy_blend(
    nb: Neighbours, background: LengthDist, cfg: PredictorConfig, prompt_tokens: float | None
) -> LengthDist:
    """The shipped (version 1) blend: weighted neighbours + global share, 24 log buckets."""
    if len(nb) == 0:
        return background
    logw = (nb.similarity - nb.similarity.max()) / cfg.similarity_temperature
    if prompt_tokens is not None and cfg.prompt_length_scale_log > 0:
        ratio = np.log(np.maximum(nb.prompt_tokens, 1.0) / max(prompt_tokens, 1.0))
        logw -= np.abs(ratio) / cfg.prompt_length_scale_log
    w = np.exp(logw - logw.max())
    missing = max(cfg.min_neighbours - len(nb), 0) / cfg.min_neighbours
    g = max(cfg.prior_weight, missing)
    samples = np.concatenate([nb.output_tokens, background.support])
    weights = np.concatenate([w / w.sum() * (1.0 - g), background.probs * g])
    return LengthDist.from_samples(samples, weights, max_points=cfg.bucket_count)


def global_dists(out: np.ndarray, prm: np.ndarray, cfg: PredictorConfig) -> dict[int, LengthDist]:
    """The predictor's global distribution per prompt band (as `LengthPredictor.global_dist`)."""
    out, prm = out[-cfg.global_window_items :], prm[-cfg.global_window_items :]
    bands = np.floor(np.log2(np.maximum(prm, 1.0))).astype(int)
    every = LengthDist.from_samples(out, max_points=cfg.bucket_count)
    res = {}
    for b in range(0, 20):
        same = bands == b
        res[b] = (
            LengthDist.from_samples(out[same], max_points=cfg.bucket_count)
            if same.sum() >= cfg.band_min_items
            else every
        )
    return res


def predict(
    train: tuple[np.ndarray, np.ndarray, np.ndarray],
    test: tuple[np.ndarray, np.ndarray],
    cfg: PredictorConfig,
    mode: str = "v2",
) -> list[LengthDist]:
    """Fit on train (vectors, output tokens, prompt tokens) and predict for test (vectors,
    prompt tokens). `mode`: v1 (legacy blend), v2 (the current `blend`)."""
    xv, y, p = train
    tv, tp = test
    ridge = OnlineRidge(xv.shape[1], l2=cfg.ridge_l2, min_items=4 * cfg.min_neighbours)
    feats = features(xv, p)
    for start in range(0, len(y), 256):  # online, in arrival order: prequential residuals
        ridge.learn(feats[start : start + 256], np.log(np.maximum(y[start : start + 256], 1.0)))
    centres = ridge.predict(features(tv, tp))
    resid = ridge.residual_sample()
    gd = global_dists(y, p, cfg)
    sims = tv @ xv.T
    k = min(cfg.k_neighbours, xv.shape[0])
    top = np.argpartition(-sims, k - 1, axis=1)[:, :k]
    dists = []
    for i in range(tv.shape[0]):
        idx = top[i][np.argsort(-sims[i, top[i]])]
        s = sims[i, idx]
        keep = s >= cfg.similarity_floor
        nb = Neighbours(s[keep].astype(np.float64), y[idx][keep], p[idx][keep])
        bg = gd[min(prompt_band(tp[i]), 19)]
        if mode == "v1":
            dists.append(legacy_blend(nb, bg, cfg, float(tp[i])))
        else:
            c = None if centres is None else float(centres[i])
            dists.append(blend(nb, bg, cfg, float(tp[i]), ridge_centre=c, residuals=resid))
    return dists


def load(name: str, chars: int) -> dict[str, Any]:
    """Records and cached embeddings of `.cache/pred/<name>-{train,test}.jsonl`."""
    from predictor.evaluate import cached_embeddings
    from predictor.model import LengthPredictor, read_jsonl

    model = LengthPredictor(PredictorConfig(embed_max_chars=chars))
    out: dict[str, Any] = {}
    for part in ("train", "test"):
        path = Path(f".cache/pred/{name}-{part}.jsonl")
        if name == "mt_bench" and part == "train":
            path = Path(".cache/pred/sharegpt-train.jsonl")  # a transfer test set
        recs = list(read_jsonl(path))
        vec = cached_embeddings(model, [r["prompt"] for r in recs], ".cache/pred")
        out[part] = (
            vec.astype(np.float64),
            np.array([float(r["output_tokens"]) for r in recs]),
            np.array([float(r["prompt_tokens"]) for r in recs]),
        )
    return out


def cv(
    data: tuple[np.ndarray, np.ndarray, np.ndarray], cfg: PredictorConfig, mode: str, folds: int
) -> dict[str, float]:
    """Mean scores over `folds` contiguous folds of the (already shuffled) train file."""
    x, y, p = data
    parts = np.array_split(np.arange(len(y)), folds)
    rows = []
    for f in range(folds):
        val = parts[f]
        fit = np.concatenate([parts[j] for j in range(folds) if j != f])
        d = predict((x[fit], y[fit], p[fit]), (x[val], p[val]), cfg, mode)
        rows.append(score(d, y[val]))
    return {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}


VARIANTS: Sequence[tuple[str, str, dict[str, Any]]] = (
    ("v1 shipped", "v1", {}),
    ("v1 + 256 buckets", "v1", {"bucket_count": 256}),
    ("v1 + temperature 1", "v1", {"similarity_temperature": 1.0}),
    ("v1 + no global mix", "v1", {"prior_weight": 0.0}),
    ("v1 + k 64", "v1", {"k_neighbours": 64}),
    ("v2 quantile points", "v2", {}),
    ("v2 + temperature 1", "v2", {"similarity_temperature": 1.0}),
    ("v2 + ridge 0.5", "v2", {"ridge_weight": 0.5}),
    ("v2 + ridge 0.5, T 1", "v2", {"ridge_weight": 0.5, "similarity_temperature": 1.0}),
    ("v2 + ridge 1", "v2", {"ridge_weight": 1.0}),
)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--set", required=True)
    ap.add_argument("--chars", type=int, default=512)
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--variant", action="append", help="JSON {mode, ...config} (repeatable)")
    args = ap.parse_args(argv)
    data = load(args.set, args.chars)
    variants = list(VARIANTS)
    for v in args.variant or []:
        spec = json.loads(v)
        variants.append((v, spec.pop("mode", "v2"), spec))
    cols = ("kendall_tau", "kendall_tau_median", "kendall_tau_mean", "mae_median")
    print(f"set {args.set} chars {args.chars}: CV on train | test")
    for label, mode, over in variants:
        cfg = dataclasses.replace(PredictorConfig(embed_max_chars=args.chars), **over)
        c = cv(data["train"], cfg, mode, args.folds) if args.set != "mt_bench" else None
        t = score(
            predict(data["train"], (data["test"][0], data["test"][2]), cfg, mode),
            data["test"][1],
        )
        cv_txt = " ".join(f"{c[k]:.3f}" for k in cols) + f" {c['coverage_10_90']:.2f}" if c else ""
        t_txt = " ".join(f"{t[k]:.3f}" for k in cols) + f" {t['coverage_10_90']:.2f}"
        print(f"{label:<28} cv {cv_txt:<40} | test {t_txt}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
