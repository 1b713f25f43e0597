"""`fit_cpu.fit_window` (speed and request overhead from one replayed window) and
`MachineBalance` (a machine whose prefill/decode balance differs from the reference)."""

from __future__ import annotations

import dataclasses

import pytest

from loadgen.engine.fit_cpu import (
    BALANCE_PROBES,
    MachineBalance,
    MachineShape,
    WindowFit,
    _probe_parts,
    balance_from,
    fit_window,
)
from loadgen.engine.profiles import CPU_TINY_VLLM, CpuTinyCoefficients, Scaled
from loadgen.schema import TraceRequest


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


def test_shape_of_another_kind_stretches_arrivals_and_shrinks_prompts() -> None:
    trace = [TraceRequest(0.0, 800, 20, "t"), TraceRequest(1.0, 40, 20, "t")]
    ref = CPU_TINY_VLLM
    # decode iterations of 8 sequences 2x slower, prefill 8x slower per token
    it = ref.a_ms + 8 * ref.per_seq_ms
    k = dataclasses.replace(ref, per_seq_ms=(2 * it - ref.a_ms) / 8,
                            per_prefill_tok_ms=ref.per_prefill_tok_ms * 8)  # fmt: skip
    shape = MachineShape.fitted(k)
    assert shape.k == k
    assert shape.stretch == pytest.approx(2.0) and shape.shrink == pytest.approx(4.0)
    out = shape.window(trace)
    assert [r.arrival_s for r in out] == pytest.approx([0.0, 2.0])
    assert [r.prompt_tokens for r in out] == [200, 10]
    assert [r.output_tokens for r in out] == [20, 20]


def test_shape_of_the_reference_kind_keeps_the_window() -> None:
    trace = [TraceRequest(0.0, 800, 20, "t"), TraceRequest(1.0, 40, 20, "t")]
    assert MachineShape().window(trace) == trace
    same = MachineShape.fitted(CPU_TINY_VLLM)
    assert (same.stretch, same.shrink) == (1.0, 1.0) and same.window(trace) == trace
    # a faster machine never compresses; prefill only a little slower is not shrunk
    fast = MachineShape.fitted(dataclasses.replace(CPU_TINY_VLLM, a_ms=3.0, per_seq_ms=0.3))
    assert fast.stretch == 1.0 and fast.shrink == 1.0


def test_balance_is_shifted_by_prefill_against_fixed_work() -> None:
    assert MachineBalance(fixed_scale=0.8, sequence_scale=4.0, prefill_scale=7.0).shifted
    assert not MachineBalance(fixed_scale=0.6, sequence_scale=0.6, prefill_scale=0.8).shifted
    # the reference kind read up to 1.7 (a noisy probe): still the reference
    assert not MachineBalance(fixed_scale=0.68, sequence_scale=0.78, prefill_scale=1.17).shifted


@pytest.mark.parametrize("scales", [(1.0, 1.0, 1.0), (0.8, 3.0, 6.0), (2.0, 1.0, 1.5)])
def test_balance_from_inverts_the_probe_predictions(scales: tuple[float, float, float]) -> None:
    """Measurements made of the profile's own predictions at known scales give them back."""
    measured = [sum(s * part for s, part in zip(scales, _probe_parts(*probe), strict=True))
                for probe in BALANCE_PROBES]  # fmt: skip
    got = balance_from(measured)
    assert (got.fixed_scale, got.sequence_scale, got.prefill_scale) == pytest.approx(scales)


def test_balance_from_noise_falls_back_to_one_scale() -> None:
    parts = [sum(_probe_parts(*probe)) for probe in BALANCE_PROBES]
    got = balance_from([parts[0] * 0.01, parts[1] * 1.2, parts[2]])  # no positive solution
    assert got.fixed_scale == got.sequence_scale == got.prefill_scale == pytest.approx(1.2)
