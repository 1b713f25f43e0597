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
