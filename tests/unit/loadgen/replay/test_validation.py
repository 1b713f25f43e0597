"""The simulator's side of the real-engine check: predicted gains and the recommended cap."""

from __future__ import annotations

from loadgen.replay.client import ReplayRequest
from loadgen.replay.validation import recommend_cap, simulated_gain


def burst(n: int = 60) -> list[ReplayRequest]:
    """`n` requests in one second, every fifth one long: a backlog where order matters."""
    return [
        ReplayRequest(arrival_s=i / n, prompt=[1], prompt_tokens=200,
                      output_tokens=400 if i % 5 == 0 else 20)
        for i in range(n)
    ]  # fmt: skip


def test_simulated_gain_reports_every_policy_against_direct() -> None:
    got = simulated_gain(burst(), "cpu-tiny-vllm", 4, policies=("sagesched", "fcfs"))
    assert set(got) == {"direct_ttlt_mean_s", "gateway_ttlt_mean_s",
                        "gateway_fcfs_ttlt_mean_s", "ratio"}  # fmt: skip
    assert got["ratio"] == got["gateway_ttlt_mean_s"] / got["direct_ttlt_mean_s"]
    # with the true lengths known, SageSched runs the short ones first: far below FCFS
    assert got["gateway_ttlt_mean_s"] < 0.8 * got["gateway_fcfs_ttlt_mean_s"]


def test_recommended_cap_is_the_best_of_the_sweep() -> None:
    cap, sweep = recommend_cap(burst(), "cpu-tiny-vllm", caps=(1, 4, 64))
    assert set(sweep) == {1, 4, 64}
    assert sweep[cap] == min(sweep.values())
    # a cap of 1 throttles batching: never the best on a burst of 60
    assert cap != 1
    assert recommend_cap(burst(), "cpu-tiny-vllm", caps=(4,))[0] == 4
