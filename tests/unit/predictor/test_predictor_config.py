from __future__ import annotations

import pytest

from predictor import PredictorConfig


def test_defaults_are_valid_and_round_trip() -> None:
    cfg = PredictorConfig()
    assert PredictorConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    "field,value",
    [("k_neighbours", 0), ("similarity_floor", 1.5), ("prior_weight", 1.0), ("max_wait_ms", -1)],
)
def test_out_of_range_is_rejected(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        PredictorConfig(**{field: value})


def test_unknown_keys_are_errors() -> None:
    with pytest.raises(ValueError, match="unknown"):
        PredictorConfig.from_dict({"k": 3})
