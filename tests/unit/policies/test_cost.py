"""Cost models map lengths to monotone costs; attained cost starts at zero."""

from __future__ import annotations

import numpy as np
import pytest

from policies import LinearProfile, attained_cost, make_cost_model


def test_kv_cost_is_kv_token_steps() -> None:
    kv = make_cost_model("kv")
    prompt, out = 100, 7
    # Σ_{t<O} (I + t) = I·O + O(O−1)/2; the model uses the continuous O²/2 + I·O.
    assert kv.cost(prompt, np.array([out]))[0] == pytest.approx(out * out / 2 + prompt * out)


def test_tokens_cost_is_output_length() -> None:
    assert make_cost_model("tokens").cost(999, np.array([3.0, 9.0])).tolist() == [3.0, 9.0]


def test_time_cost_uses_profile() -> None:
    profile = LinearProfile(prefill_base_s=0.01, prefill_s_per_token=1e-4, step_s=0.02)
    t = make_cost_model("time", profile)
    assert t.cost(100, np.array([10.0]))[0] == pytest.approx(0.01 + 0.01 + 0.2)


@pytest.mark.parametrize("name", ["tokens", "kv", "time"])
def test_costs_strictly_increase_and_start_at_zero(name: str) -> None:
    model = make_cost_model(name, LinearProfile(step_s=0.01, context_s_per_token=1e-6))
    costs = model.cost(500, np.arange(1, 200, dtype=float))
    assert np.all(np.diff(costs) > 0)
    assert attained_cost(model, 500, 0) == 0.0
    assert attained_cost(model, 500, 5) == pytest.approx(model.cost(500, np.array([5.0]))[0])


def test_unknown_cost_model() -> None:
    with pytest.raises(ValueError, match="unknown cost model"):
        make_cost_model("flops")


def test_time_cost_charges_only_the_uncached_prefill() -> None:
    profile = LinearProfile(prefill_base_s=0.01, prefill_s_per_token=1e-4, step_s=0.02)
    t = make_cost_model("time", profile)
    whole = t.cost(100, np.array([10.0]))[0]
    assert t.cost(100, np.array([10.0]), 0)[0] == whole
    assert t.cost(100, np.array([10.0]), 60)[0] == pytest.approx(whole - 60 * 1e-4)
    assert t.cost(100, np.array([10.0]), 500)[0] == pytest.approx(0.01 + 0.2)  # never below 0
    assert attained_cost(t, 100, 5, 60) == pytest.approx(t.cost(100, np.array([5.0]), 60)[0])
    for name in ("tokens", "kv"):  # decode work and memory held: no prefill to save
        m = make_cost_model(name)
        assert m.cost(100, np.array([10.0]), 60)[0] == m.cost(100, np.array([10.0]))[0]


def test_sagesched_time_key_rewards_a_cached_prefix() -> None:
    from policies import Job, LengthDist, gittins_index, make_policy

    profile = LinearProfile(prefill_base_s=5e-3, prefill_s_per_token=2e-5, step_s=1e-4)
    policy = make_policy("sagesched", cost="time").on_engine(profile)
    job = Job(id=0, arrival_s=0.0, prompt_tokens=4000, dist=LengthDist.point(50))
    plain = policy.key(job, 0.0)
    expected = -gittins_index(np.array([5e-3 + 2e-5 * 4000 + 50 * 1e-4]), np.array([1.0]), 0.0)
    assert plain == (expected,)  # cached_tokens=0: the key as before
    job.cached_tokens = 3000
    assert policy.key(job, 0.0) < plain  # cheaper to serve there: a higher index
    assert make_policy("sagesched").key(job, 0.0) == make_policy("sagesched").key(
        Job(id=1, arrival_s=0.0, prompt_tokens=4000, dist=LengthDist.point(50)), 0.0
    )  # kv cost: unchanged by caching
