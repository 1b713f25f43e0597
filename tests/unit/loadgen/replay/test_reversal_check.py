"""The real-engine reversal check's pure parts: which reversal and window it picks, how each
contender maps to vLLM flags, the scaled-down case and the order comparison."""

from __future__ import annotations

import pytest

from loadgen.engine.configs import engine_config
from loadgen.regions import REGIONS
from loadgen.replay import reversal_check as rc
from loadgen.schema import TraceRequest, Window
from loadgen.study.grid import POLICIES, Row

A, B = "lssp-azure2024", "lssp-burstgpt"


def _rows(values: dict[tuple[str, str], list[float]]) -> list[Row]:
    """ANWG rows at KNEE: values[(source, policy)] is one value per window."""
    return [
        Row(source, f"{source}-w{i:02d}", "knee", "KNEE", policy, "anwg", v)
        for (source, policy), vs in values.items()
        for i, v in enumerate(vs)
    ]


def _noisy(level: float, n: int = 10) -> list[float]:
    return [level + 0.01 * ((i * 7) % 5 - 2) for i in range(n)]  # mean: level


def test_supported_reversals_finds_the_flip_and_its_strength() -> None:
    rows = _rows({
        (A, "p1"): _noisy(0.9), (A, "p2"): _noisy(0.5), (A, "p3"): _noisy(0.2),
        (B, "p1"): _noisy(0.4), (B, "p2"): _noisy(0.8), (B, "p3"): _noisy(0.1),
    })  # fmt: skip
    found = rc.supported_reversals(rows, policies=("p1", "p2", "p3"), n_boot=400)
    assert [(r.first, r.second, r.source_a, r.source_b) for r in found] == [("p1", "p2", A, B)]
    [r] = found
    assert r.diff_a == pytest.approx(0.4) and r.diff_b == pytest.approx(-0.4)
    assert r.strength == pytest.approx(min(0.4 / 0.5, 0.4 / 0.4))


def test_a_flip_within_the_margin_is_not_supported() -> None:
    rows = _rows({
        (A, "p1"): _noisy(0.82), (A, "p2"): _noisy(0.80),
        (B, "p1"): _noisy(0.40), (B, "p2"): _noisy(0.80),
    })  # fmt: skip
    assert rc.supported_reversals(rows, policies=("p1", "p2"), n_boot=400) == []


def test_representative_window_is_the_one_nearest_the_median() -> None:
    rows = _rows({(A, "p1"): [0.9, 0.5, 0.7, 0.6, 0.1], (A, "p2"): [0.5] * 5})
    diffs = rc.window_diffs(rows, A, "KNEE", "p1", "p2")
    assert diffs[f"{A}-w00"] == pytest.approx(0.4)
    assert rc.representative_window(diffs) == f"{A}-w03"  # differences .4 0 .2 .1 -.4: median .1
    assert rc.representative_window({"b": 1.0, "a": 3.0}) == "a"  # a tie: the first id
    with pytest.raises(ValueError):
        rc.representative_window({})


def _flag(flags: tuple[str, ...], name: str) -> str:
    return flags[flags.index(name) + 1]


@pytest.mark.parametrize("contender", sorted(rc.VLLM_ARMS))
def test_vllm_flags_say_what_the_simulated_arm_runs(contender: str) -> None:
    arm = rc.VLLM_ARMS[contender]
    assert POLICIES[arm.paper][0] == contender  # the study's contender for that paper policy
    flags = rc.vllm_args(contender)
    played = arm.simulated(as_played=True)
    assert int(_flag(flags, "--max-num-batched-tokens")) == played.max_batch_tokens
    assert int(_flag(flags, "--max-num-seqs")) == played.max_seqs
    chunked = "--enable-chunked-prefill" in flags
    assert chunked != ("--no-enable-chunked-prefill" in flags)
    chunk = played.max_batch_tokens if chunked else None
    assert played.chunk_tokens == chunk
    priority = "--scheduling-policy" in flags and _flag(flags, "--scheduling-policy") == "priority"
    assert arm.priority_by_prompt == priority
    assert (played.waiting_order == "prompt") == arm.priority_by_prompt
    assert played.budget_counts_decodes  # vLLM V1 spends one budget token per decode
    assert not played.prefill_pauses_decodes and played.decode_first  # V1 runs decodes first
    assert bool(arm.played) == bool(arm.not_reproduced)  # what differs is said
    assert arm.simulated(as_played=False) == engine_config(contender)


def test_slai_as_vllm_plays_it_has_no_deferral_and_pays_prefill() -> None:
    played = rc.VLLM_ARMS["slai"].simulated(as_played=True)
    assert played.decode_defer_tbt_s is None and not played.prefill_free
    assert engine_config("slai").decode_defer_tbt_s is not None
    with pytest.raises(ValueError, match="no vLLM mapping"):
        rc.vllm_args("kv-constrained")


def _window(n: int = 8) -> Window:
    reqs = tuple(
        TraceRequest(i * 0.5, 300 * (i + 1), 40 * (i + 1), A, predicted_output_tokens=44 * (i + 1),
                     deadline_s=i * 0.5 + 100.0)
        for i in range(n)
    )  # fmt: skip
    return Window(A, "w", reqs)


def test_scaled_trace_caps_lengths_and_recomputes_the_paper_slo() -> None:
    trace = rc.scaled_trace(_window(), 5, 1000, 100)
    assert len(trace) == 5
    assert [r.prompt_tokens for r in trace] == [300, 600, 900, 1000, 1000]
    assert [r.output_tokens for r in trace] == [40, 80, 100, 100, 100]
    assert [r.predicted_output_tokens for r in trace] == [44, 88, 110, 110, 110]
    for r in trace:
        slack = 20 * (0.0004 * r.prompt_tokens + 0.02 * (r.predicted_output_tokens or 0))
        assert r.deadline_s == pytest.approx(r.arrival_s + slack)


def test_cpu_load_factor_is_the_region_multiple_of_one_knee() -> None:
    trace = rc.scaled_trace(_window(), 8, 1000, 100)
    knee = rc.cpu_load_factor(trace, "KNEE", "cpu-tiny-vllm")
    high = rc.cpu_load_factor(trace, "HIGH_PRESSURE", "cpu-tiny-vllm")
    assert knee > 0 and high == pytest.approx(REGIONS["HIGH_PRESSURE"] * knee)


def test_flip_holds_compares_signs() -> None:
    sim = {"a": 0.9, "b": 0.5}
    assert rc.flip_holds(sim, {"a": 0.7, "b": 0.6}, "a", "b") is True
    assert rc.flip_holds(sim, {"a": 0.6, "b": 0.7}, "a", "b") is False
    assert rc.flip_holds(sim, {"a": 0.6, "b": 0.6}, "a", "b") is None
    assert rc.flip_holds({"a": 1.0, "b": 1.0}, {"a": 0.6, "b": 0.7}, "a", "b") is None
