"""`fit_cpu.fit_window`: speed and request overhead from one replayed window."""

from __future__ import annotations

import pytest

from loadgen.engine.fit_cpu import WindowFit, fit_window
from loadgen.engine.profiles import CPU_TINY_VLLM, CpuTinyCoefficients, Scaled


def test_speed_is_the_tpot_ratio_and_overhead_meets_the_ttft() -> None:
    k = CpuTinyCoefficients(request_overhead_ms=5.0)
    fit = fit_window({"tpot_ms": 4.0, "ttft_ms": 30.0}, {"tpot_ms": 8.0, "ttft_ms": 40.0}, k)
    assert fit.time_scale == pytest.approx(0.5)
    # at speed 0.5 the emulated TTFT is about 0.5 * (40 + shift): 30 needs a shift of +20
    assert fit.request_overhead_ms == pytest.approx(25.0)


def test_overhead_never_goes_below_zero() -> None:
    fit = fit_window({"tpot_ms": 8.0, "ttft_ms": 1.0}, {"tpot_ms": 8.0, "ttft_ms": 40.0})
    assert fit.time_scale == pytest.approx(1.0)
    assert fit.request_overhead_ms == 0.0


def test_profile_is_the_committed_shape_at_the_fitted_speed() -> None:
    prof = WindowFit(time_scale=0.5, request_overhead_ms=9.0).profile()
    assert isinstance(prof, Scaled) and prof.factor == 0.5
    base = Scaled(prof.inner, 1.0)
    assert prof.iteration_s(4, 800, 128) == pytest.approx(0.5 * base.iteration_s(4, 800, 128))
    expected = (9.0 + CPU_TINY_VLLM.overhead_per_running_ms * 3) / 1000 * 0.5
    assert prof.request_overhead_s(3) == pytest.approx(expected)
