"""How well can ANY predictor order output lengths from the prompt alone? (noise ceiling)

    python -m bench.predictor_ceiling [--set sharegpt]

1. Exact repeats: ShareGPT holds the same first-turn prompt answered several times (different
   users, different conversations; deduplication drops them from the train/test files). Two
   answers to one prompt are two draws from the length distribution given that prompt, so the
   Kendall τ between the first and second answer's length over all repeated prompts is what a
   predictor that knew each prompt's answer distribution exactly, and guessed one draw, would
   score; the conditional median scores somewhat more (reported via the split-half estimate
   below) but no predictor from the prompt can order the draws' noise.
2. Near duplicates: test prompts whose nearest train prompt has cosine ≥ 0.95 / 0.9 / 0.85
   (cached embeddings): τ of that neighbour's length vs the truth, and its MAE relative to
   the train median's (how much one very similar example tells).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict

import numpy as np
from scipy.stats import kendalltau


def exact_repeats(source: str) -> dict[str, float]:
    """τ between two answers' lengths for prompts answered at least twice."""
    from predictor import datasets
    from predictor.offline import load_tokenizer

    base = datasets.shared_data_dir()
    if source == "sharegpt":
        raw = datasets.sharegpt_pairs(base / datasets.SHAREGPT_FILE)
    else:
        raw = datasets.alpaca_pairs(base / datasets.ALPACA_FILE)
    groups: dict[str, list[str]] = defaultdict(list)
    for _, prompt, answer in raw:
        groups[prompt.strip()].append(answer)
    reps = [(a[0], a[1]) for a in groups.values() if len(a) >= 2 and a[0] != a[1]]
    if len(reps) < 10:
        return {"prompts_repeated": float(len(reps))}
    tok = load_tokenizer()
    first = [len(t) for t in tok([a for a, _ in reps], add_special_tokens=False)["input_ids"]]
    second = [len(t) for t in tok([b for _, b in reps], add_special_tokens=False)["input_ids"]]
    log_gap = np.abs(np.log(np.maximum(first, 1)) - np.log(np.maximum(second, 1)))
    a1, a2 = np.asarray(first, dtype=float), np.asarray(second, dtype=float)
    return {
        "prompts_repeated": float(len(reps)),
        "tau_answer1_vs_answer2": float(kendalltau(a1, a2).statistic),
        "median_abs_log_ratio": float(np.median(log_gap)),
        # MAE of "the other answer's length" vs of the subset's median (the global baseline)
        "mae_other_answer_vs_global": float(
            np.mean(np.abs(a1 - a2)) / np.mean(np.abs(np.median(a1) - a2))
        ),
    }


def near_duplicates(name: str, threshold: float) -> dict[str, float]:
    """τ of the nearest train neighbour's length vs the truth, for close neighbours."""
    from bench.predictor_ablation import load

    d = load(name, 512)
    x, y, _ = d["train"]
    tx, ty, _ = d["test"]
    sims = tx @ x.T
    best = sims.argmax(axis=1)
    close = sims[np.arange(len(ty)), best] >= threshold
    if close.sum() < 10:
        return {"test_with_near_duplicate": float(close.sum())}
    nb, truth = y[best][close], ty[close]
    return {
        "threshold": threshold,
        "test_with_near_duplicate": float(close.sum()),
        "tau_neighbour_vs_truth": float(kendalltau(nb, truth).statistic),
        "mae_neighbour_vs_global": float(
            np.mean(np.abs(nb - truth)) / np.mean(np.abs(np.median(y) - truth))
        ),
    }


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--set", default="sharegpt")
    args = ap.parse_args(argv)
    print(args.set, "exact repeats:", exact_repeats(args.set))
    for threshold in (0.95, 0.9, 0.85):
        print(args.set, "near duplicates:", near_duplicates(args.set, threshold))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
