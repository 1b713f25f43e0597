"""Shared fixtures for the trace-reader tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadgen.traces import shared_data_dir


@pytest.fixture(scope="session")
def shared() -> Path:
    """The shared data folder; skips the test when it is absent (installed package, CI)."""
    folder = shared_data_dir()
    if not (folder / "traces").exists():
        pytest.fail(f"shared data not at {folder} (set SAGESCHED_SHARED_DATA)")
    return folder
