from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import sagesched_cli
from policies import LengthDist
from predictor import LengthPredictor
from predictor.datasets import build_split, load_pairs
from predictor.evaluate import (
    GlobalBaseline,
    LengthRegressionBaseline,
    pinball,
    scheduling_key,
    score,
)
from predictor.tuning import GRID

KEYS = {"mae_median", "spearman", "kendall_tau", "coverage_10_90"}
KEYS |= {"pinball_0.1", "pinball_0.5", "pinball_0.9"}


def test_pinball_loss() -> None:
    y = np.array([10.0, 10.0])
    assert pinball(0.5, np.array([10.0, 10.0]), y) == 0.0
    assert pinball(0.9, np.array([0.0, 0.0]), y) == pytest.approx(9.0)  # under-prediction
    assert pinball(0.9, np.array([20.0, 20.0]), y) == pytest.approx(1.0)  # over-prediction


def test_perfect_predictions_score_perfectly() -> None:
    truth = [5.0, 50.0, 500.0, 20.0]
    s = score([LengthDist.point(t) for t in truth], truth)
    assert s["mae_median"] == 0.0 and s["pinball_0.5"] == 0.0
    assert s["spearman"] == pytest.approx(1.0) and s["kendall_tau"] == pytest.approx(1.0)
    assert s["coverage_10_90"] == 1.0


def test_constant_prediction_has_no_ordering_information() -> None:
    d = LengthDist.from_samples([10, 100, 1000])
    s = score([d] * 4, [5.0, 50.0, 500.0, 20.0])
    assert s["kendall_tau"] == 0.0 and s["spearman"] == 0.0
    assert s["mae_median"] == pytest.approx(np.mean([95, 50, 400, 80]))


def test_scheduling_key_prefers_short_jobs() -> None:
    assert scheduling_key(LengthDist.point(10)) < scheduling_key(LengthDist.point(100))


def test_baselines_fit_what_they_should() -> None:
    train = [{"prompt": "", "prompt_tokens": p, "output_tokens": 3 * p} for p in range(1, 200)]
    reg = LengthRegressionBaseline()
    reg.fit(train)
    assert reg.coef[1] == pytest.approx(1.0, abs=1e-6)  # log-log slope of y = 3x
    (d,) = reg.predict([{"prompt_tokens": 50}])
    assert d.quantile(0.5) == pytest.approx(150, rel=0.01)
    glob = GlobalBaseline()
    glob.fit(train)
    assert glob.predict([{}])[0].mean() == pytest.approx(300, rel=0.05)


def test_sharegpt_pairs_are_first_turns(shared_data: Path) -> None:
    pairs = load_pairs("sharegpt", shared_data)
    assert len(pairs) > 5_000
    assert len({p for _, p, _ in pairs}) == len(pairs)  # deduplicated
    assert pairs[0][0] == "QWJhYvA_0" and pairs[0][1].startswith("Summarize the main ideas")


@pytest.mark.slow
def test_eval_cli_on_sharegpt(
    shared_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Build a 400/100 split from the shared ShareGPT file, then `predictor eval --json`."""
    train, test = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    rc = sagesched_cli.main(
        ["predictor", "build-dataset", "--train-out", str(train), "--test-out", str(test),
         "--n-train", "400", "--n-test", "100", "--seed", "7", "--data-dir", str(shared_data)]
    )  # fmt: skip
    assert rc == 0
    test_rows = [json.loads(line) for line in test.read_text().splitlines()]
    assert len(test_rows) == 100 and all(r["output_tokens"] > 0 for r in test_rows)
    train_prompts = {json.loads(line)["prompt"] for line in train.read_text().splitlines()}
    assert not train_prompts & {r["prompt"] for r in test_rows}
    capsys.readouterr()
    rc = sagesched_cli.main(
        ["predictor", "eval", "--train", str(train), "--test", str(test), "--json",
         "--set", "embed_max_chars=256", "--cv-folds", "3",
         "--cache-dir", str(tmp_path / "cache")]
    )  # fmt: skip
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    result = out["results"]
    assert set(result) == {"semantic", "global", "length_regression"}
    assert set(out["chosen_by_cv"]) <= set(GRID)  # CV on train chose only grid settings
    assert -1.0 <= result["semantic"]["kendall_tau_rank_score"] <= 1.0
    for row in result.values():
        assert set(row) >= KEYS
        assert 0.0 <= row["coverage_10_90"] <= 1.0 and row["mae_median"] > 0
    assert result["global"]["kendall_tau"] == 0.0


def test_build_split_prefers_a_full_test_set(shared_data: Path, tmp_path: Path) -> None:
    class CharTokenizer:  # a stand-in: one token per character
        def __call__(self, texts: list[str], **_: object) -> dict[str, list[list[int]]]:
            return {"input_ids": [[0] * len(t) for t in texts]}

    n_train, n_test = build_split(
        "alpaca", 10_000, 50, tmp_path / "a.jsonl", tmp_path / "b.jsonl",
        tokenizer=CharTokenizer(), data_dir=shared_data,
    )  # fmt: skip
    assert n_test == 50 and n_train == len(load_pairs("alpaca", shared_data)) - 50
    first = json.loads((tmp_path / "b.jsonl").read_text().splitlines()[0])
    assert first["output_tokens"] > 0 and first["source"] == "alpaca"


def test_cli_rejects_unknown_config_keys(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="bad --set"):
        sagesched_cli.main(["predictor", "eval", "--train", "x", "--test", "y", "--set", "nope=1"])


def test_warm_cli_writes_a_loadable_snapshot(tmp_path: Path) -> None:
    src = tmp_path / "warm.jsonl"
    rows = [{"prompt": f"Say hi to {n}.", "output_tokens": 5 + i} for i, n in enumerate("abcde")]
    src.write_text("\n".join(json.dumps(r) for r in rows))
    snap = tmp_path / "snap" / "history.npz"
    rc = sagesched_cli.main(
        ["predictor", "warm", "--from", str(src), "--out", str(snap), "--set", "capacity_items=50"]
    )
    assert rc == 0
    model = LengthPredictor.load(snap)
    assert len(model.index) == 5 and model.index.capacity == 50
    assert model.predict("Say hi to f.").quantile(0.5) < 20


def test_warm_cli_into_a_models_own_state(tmp_path: Path) -> None:
    src = tmp_path / "warm.jsonl"
    rows = [{"prompt": f"Say hi to {n}.", "output_tokens": 5 + i} for i, n in enumerate("abcde")]
    src.write_text("\n".join(json.dumps(r) for r in rows))
    snap = tmp_path / "history.npz"
    argv = ["predictor", "warm", "--from", str(src), "--out", str(snap), "--model", "tiny-llama"]
    assert sagesched_cli.main(argv) == 0
    model = LengthPredictor.load(snap)
    assert model.models() == ["", "tiny-llama"]
    assert len(model.index) == 0  # the shared (default) state learned nothing
    assert len(model.own_state("tiny-llama").index) == 5
