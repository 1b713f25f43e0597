"""Latency profiles: registry, the constant-step model, the H200 fit, and scaled profiles."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadgen.engine import fit_h200
from loadgen.engine.profiles import (
    H200_LLAMA3_8B,
    H200_QWEN3_32B,
    LatencyProfile,
    Scaled,
    make_profile,
    profile_names,
    register_profile,
)


def test_registry_has_both_profiles_and_rejects_unknown() -> None:
    assert {"h200-llama3-8b", "lssp-constant"} <= set(profile_names())
    with pytest.raises(ValueError, match="unknown latency profile"):
        make_profile("nope")


def test_duplicate_registration_is_an_error() -> None:
    class Dup(LatencyProfile):
        name = "lssp-constant"
        description = "duplicate"

    with pytest.raises(ValueError, match="registered twice"):
        register_profile(Dup)


def test_lssp_constant_is_one_millisecond_whatever_the_shape() -> None:
    p = make_profile("lssp-constant")
    assert p.iteration_s(64, 100_000, 4096) == pytest.approx(0.001)
    assert p.decode_run_s(10, 0, 7) == pytest.approx(0.007)
    assert p.steps_within(1, 0, 0.0105) == 11
    assert p.steps_within(1, 0, 0.010) == 10
    assert p.grid_s == pytest.approx(0.001)


@pytest.mark.parametrize(("n", "ctx", "steps"), [(1, 128, 1), (64, 64 * 2048, 37), (200, 10**5, 5)])
def test_h200_decode_run_closed_form_matches_the_sum(n: int, ctx: int, steps: int) -> None:
    p = make_profile("h200-llama3-8b")
    total = sum(p.iteration_s(n, ctx + j * n, 0) for j in range(steps))
    assert p.decode_run_s(n, ctx, steps) == pytest.approx(total, rel=1e-9)
    k = p.steps_within(n, ctx, total)
    assert k == steps


@pytest.mark.parametrize(
    ("shape", "ms"),
    [((1, 1024, 0), 5.0), ((64, 64 * 2048, 0), 9.3), ((256, 256 * 1024, 0), 16.1),
     ((0, 0, 1024), 25.7), ((0, 0, 8192), 231.0), ((64, 64 * 1024, 512), 18.47)],
)  # fmt: skip
def test_h200_profile_matches_the_reference_numbers(shape: tuple[int, int, int], ms: float) -> None:
    assert make_profile("h200-llama3-8b").iteration_s(*shape) * 1000 == pytest.approx(ms, rel=0.08)


def test_fit_script_reproduces_the_committed_coefficients() -> None:
    folder = fit_h200.DEFAULT_DIR
    if not (folder / fit_h200.FILES[0]).exists():
        pytest.fail(f"calibration data not at {folder}")
    fitted = fit_h200.fit(fit_h200.load(Path(folder)))
    k = H200_LLAMA3_8B
    assert fitted["decode"]["per_ctx_ms"] == pytest.approx(k.decode_per_ctx_ms, rel=1e-4)
    assert fitted["prefill"]["per_tok_ms"] == pytest.approx(k.prefill_per_tok_ms, rel=1e-4)
    assert fitted["mixed"]["a_ms"] == pytest.approx(k.mixed_a_ms, rel=1e-4)
    assert max(r["max_rel_err"] for r in fitted.values()) < 0.08


@pytest.mark.parametrize("factor", [0.5, 0.73, 2.0])
def test_scaled_profile_multiplies_every_time(factor: float) -> None:
    inner = make_profile("cpu-tiny-vllm")
    fast = Scaled(inner, factor)
    assert fast.request_overhead_s(3) == pytest.approx(inner.request_overhead_s(3) * factor)
    assert fast.iteration_s(4, 900, 128) == pytest.approx(inner.iteration_s(4, 900, 128) * factor)
    assert fast.decode_run_s(4, 900, 37) == pytest.approx(inner.decode_run_s(4, 900, 37) * factor)
    # steps_within stays the smallest k whose scaled run reaches the budget
    k = fast.steps_within(4, 900, 0.25)
    assert fast.decode_run_s(4, 900, k) >= 0.25 > fast.decode_run_s(4, 900, k - 1)


def test_scaled_profile_slows_the_simulation_and_refuses_grid_profiles() -> None:
    from loadgen.engine.configs import engine_config
    from loadgen.replay.prompts import synthetic_window
    from loadgen.sim.simulator import Contender, simulate
    from policies.registry import parse_policy

    trace = synthetic_window(n=40, rate_per_s=4.0, seed=3)
    inner = make_profile("cpu-tiny-vllm")

    def last_finish(profile: LatencyProfile) -> float:
        fcfs = Contender("fcfs", parse_policy("fcfs"), engine_config("vllm-fcfs"), None)
        res = simulate(trace, fcfs, profile)
        return max(r.finish_s for r in res.records)

    assert last_finish(Scaled(inner, 2.0)) > last_finish(inner) > last_finish(Scaled(inner, 0.5))
    with pytest.raises(ValueError, match="discrete-step"):
        Scaled(make_profile("lssp-constant"), 0.5)
    with pytest.raises(ValueError, match="positive"):
        Scaled(inner, 0.0)


@pytest.mark.parametrize(
    ("shape", "ms"),
    [((1, 1024, 0), 18.4), ((64, 64 * 2048, 0), 29.2), ((256, 256 * 512, 0), 40.1),
     ((0, 0, 1024), 111.0), ((0, 0, 8192), 971.0)],
)  # fmt: skip
def test_qwen3_32b_profile_matches_the_calibration(shape: tuple[int, int, int], ms: float) -> None:
    assert make_profile("h200-qwen3-32b").iteration_s(*shape) * 1000 == pytest.approx(ms, rel=0.08)


def test_fit_script_reproduces_the_qwen_coefficients_and_the_additive_mixed_rule() -> None:
    folder = fit_h200.DEFAULT_DIR
    fitted = fit_h200.fit(fit_h200.load(Path(folder), "qwen3-32b"))
    k = H200_QWEN3_32B
    assert "mixed" not in fitted  # no mixed measurements for this shape
    assert fitted["decode"]["per_seq_ms"] == pytest.approx(k.decode_per_seq_ms, rel=1e-4)
    assert fitted["prefill"]["per_tok_ms"] == pytest.approx(k.mixed_per_tok_ms, rel=1e-4)
    # the additive rule, checked where mixed rows exist (the Llama shape)
    llama = fit_h200.load(Path(folder))
    coefs = fit_h200.fit(llama)
    errors = [
        abs(fit_h200.additive_mixed(coefs, r["B"], r["B"] * r["L"], r["C"]) - r["ms"]) / r["ms"]
        for r in llama
        if r["kind"] == "mixed"
    ]
    assert max(errors) < 0.23


@pytest.mark.parametrize("name", ["h200-llama3-8b", "h200-qwen3-32b", "cpu-tiny-vllm"])
def test_cost_profile_is_a_requests_share_of_the_engine(name: str) -> None:
    p = make_profile(name)
    c = p.cost_profile(64)
    # 64 requests' shares of a decode step make the step
    assert 64 * c.step_s == pytest.approx(p.iteration_s(64, 0, 0))
    assert 64 * (c.step_s + 1000 * c.context_s_per_token) == pytest.approx(
        p.iteration_s(64, 64 * 1000, 0), rel=1e-3
    )
    assert c.prefill_s(1025) == pytest.approx(p.iteration_s(0, 0, 1025), rel=0.05)
    # the batch shares the fixed cost: bigger batch, cheaper step
    assert p.cost_profile(256).step_s < c.step_s
