"""Shared fixtures: one real MiniLM embedder per session, and the shared data folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from predictor import Embedder, LengthPredictor, PredictorConfig
from predictor.datasets import SHAREGPT_FILE, shared_data_dir


@pytest.fixture(scope="session")
def embedder() -> Embedder:
    """The real bundled model on the CPU, one torch thread (the production default)."""
    return Embedder(device="cpu", torch_threads=1)


@pytest.fixture
def small_config() -> PredictorConfig:
    """A small, fast configuration (tiny ring so replacement is easy to exercise)."""
    return PredictorConfig(capacity_items=1_000, min_neighbours=2, global_window_items=200)


@pytest.fixture
def predictor(embedder: Embedder, small_config: PredictorConfig) -> LengthPredictor:
    return LengthPredictor(small_config, embedder=embedder)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The shared data folder ($SAGESCHED_SHARED_DATA or ../shared/data); a missing folder
    fails the tests that need it, loudly, rather than skipping them."""
    base = shared_data_dir()
    if not (base / SHAREGPT_FILE).is_file():
        pytest.fail(f"shared ShareGPT file not found under {base}; set SAGESCHED_SHARED_DATA")
    return base
