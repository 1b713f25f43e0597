"""The portability grid on a few cells: tidy rows, every executor gives the same rows."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from loadgen.study import grid

SMALL = dict(
    windows=1,
    axes=("knee", "util"),
    regions={"knee": ("LOW", "HIGH_PRESSURE"), "util": ("U1",)},
    policies=("fifo", "edf", "slai_faithful"),
)


@pytest.fixture(scope="module")
def serial_rows() -> list[grid.Row]:
    return grid.run_grid(grid.plan(**SMALL), executor="serial", progress=False)  # type: ignore[arg-type]


def test_policy_catalog_matches_the_paper() -> None:
    assert len(grid.POLICIES) == 13 and len(grid.HEADLINE_POLICIES) == 10
    assert not set(grid.ALIASES) & set(grid.HEADLINE_POLICIES)
    for name in grid.POLICIES:
        assert grid.contender(name).name == grid.POLICIES[name][0]
    assert grid.contender("fifo").inflight_cap is None


def test_tidy_rows_cover_every_cell_and_metric(serial_rows: list[grid.Row]) -> None:
    cells = 3 * (2 + 1) * 3  # sources x load points x policies
    assert len(serial_rows) == cells * len(grid.METRICS)
    assert {r.metric for r in serial_rows} == set(grid.METRICS)
    anwg = [r.value for r in serial_rows if r.metric == "anwg"]
    assert all(0.0 <= v <= 1.0 for v in anwg)
    # the knee is where FIFO starts to miss: at half of it FIFO meets every deadline
    low_fifo = [
        r.value
        for r in serial_rows
        if (r.axis, r.region, r.policy, r.metric) == ("knee", "LOW", "fifo", "anwg")
    ]
    assert low_fifo == [1.0, 1.0, 1.0]


def test_process_executor_matches_serial(serial_rows: list[grid.Row]) -> None:
    rows = grid.run_grid(grid.plan(**SMALL), executor="process", workers=2, progress=False)  # type: ignore[arg-type]
    assert _same(rows, serial_rows)


def test_ray_executor_matches_serial(serial_rows: list[grid.Row]) -> None:
    rows = grid.run_grid(grid.plan(**SMALL), executor="ray", workers=2, progress=False)  # type: ignore[arg-type]
    assert _same(rows, serial_rows)


def test_csv_round_trip(serial_rows: list[grid.Row], tmp_path: Path) -> None:
    path = grid.write_rows(serial_rows, tmp_path / "t.csv.gz")
    assert _same(grid.read_rows(path), serial_rows)


def _same(a: list[grid.Row], b: list[grid.Row]) -> bool:
    return len(a) == len(b) and all(
        x[:6] == y[:6] and (x.value == y.value or (math.isnan(x.value) and math.isnan(y.value)))
        for x, y in zip(a, b, strict=True)
    )
