"""Cost models: what one unit of a job's service costs the engine.

A cost model maps (prompt tokens I, output tokens O) to a cost, monotone in O, so a length
distribution becomes a cost distribution with the same probabilities and the tokens generated
so far become attained cost. Three are provided:

- `tokens`: C = O, decode steps.
- `kv`:     C = O²/2 + I·O, the KV-cache token-steps held over the decode (Σ_{t<O} (I + t)),
            i.e. memory pressure; SageSched's cost (REFERENCE.md §1).
- `time`:   expected engine seconds from a latency profile (prefill plus per-step decode time
            that grows with batch context); the profile object is passed in.

Every model takes `cached_tokens`, the prompt tokens expected to be in the serving backend's
prefix cache (`Job.cached_tokens`, set by the router): only `time` reads it, charging the
prefill of the uncached rest (`tokens` and `kv` measure decode work and memory held, which a
cached prefix does not change). 0 charges the whole prompt, as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

import numpy as np

from policies.dist import FloatArray, LengthDist


@runtime_checkable
class LatencyProfile(Protocol):
    """What the `time` cost model needs from an engine latency profile (seconds)."""

    def prefill_s(self, prompt_tokens: float) -> float:
        """Time to prefill a prompt of this many tokens alone."""
        ...

    def request_decode_s(self, prompt_tokens: float, output_tokens: FloatArray) -> FloatArray:
        """Engine time attributable to decoding `output_tokens` for one request."""
        ...


@dataclass(frozen=True, slots=True)
class LinearProfile:
    """The simplest useful latency profile: linear prefill, linear-in-context decode steps.

    A decode step for one request at context L costs `step_s + context_s_per_token · L`; the
    whole decode of O tokens after an I-token prompt is therefore
    O·step_s + context_s_per_token·(I·O + O(O−1)/2). The engine model's richer profiles (fitted
    batch curves) live with the simulator.
    """

    prefill_base_s: float = 0.0
    """Fixed cost of a prefill (seconds)."""
    prefill_s_per_token: float = 0.0
    """Prefill cost per prompt token (seconds)."""
    step_s: float = 0.001
    """Per-request share of one decode step (seconds)."""
    context_s_per_token: float = 0.0
    """Extra decode-step cost per token of context (seconds)."""

    def prefill_s(self, prompt_tokens: float) -> float:
        return self.prefill_base_s + self.prefill_s_per_token * prompt_tokens

    def request_decode_s(self, prompt_tokens: float, output_tokens: FloatArray) -> FloatArray:
        o = np.asarray(output_tokens, dtype=np.float64)
        return o * self.step_s + self.context_s_per_token * (prompt_tokens * o + o * (o - 1) / 2)


class CostModel(Protocol):
    """Maps output lengths to costs; must be strictly increasing in output tokens."""

    name: ClassVar[str]

    def cost(
        self, prompt_tokens: float, output_tokens: FloatArray, cached_tokens: float = 0.0
    ) -> FloatArray:
        """Cost of a job of `prompt_tokens` input (`cached_tokens` of them in the backend's
        prefix cache) after each of `output_tokens` outputs."""
        ...


class TokensCost:
    """C = O: every output token costs the same."""

    name: ClassVar[str] = "tokens"

    def cost(
        self, prompt_tokens: float, output_tokens: FloatArray, cached_tokens: float = 0.0
    ) -> FloatArray:
        return np.asarray(output_tokens, dtype=np.float64)


class KVCost:
    """C = O²/2 + I·O: KV-cache token-steps held while decoding (the memory-bound term)."""

    name: ClassVar[str] = "kv"

    def cost(
        self, prompt_tokens: float, output_tokens: FloatArray, cached_tokens: float = 0.0
    ) -> FloatArray:
        o = np.asarray(output_tokens, dtype=np.float64)
        return o * o / 2.0 + prompt_tokens * o


@dataclass(frozen=True, slots=True)
class TimeCost:
    """Expected engine seconds: the prefill of the uncached prompt plus the decode time of O
    tokens under `profile` (decode attends to the whole prompt, cached or not)."""

    profile: LatencyProfile
    name: ClassVar[str] = "time"

    def cost(
        self, prompt_tokens: float, output_tokens: FloatArray, cached_tokens: float = 0.0
    ) -> FloatArray:
        decode = self.profile.request_decode_s(prompt_tokens, output_tokens)
        uncached = max(prompt_tokens - cached_tokens, 0.0)
        return self.profile.prefill_s(uncached) + decode


def make_cost_model(name: str, profile: LatencyProfile | None = None) -> CostModel:
    """Build a cost model by its stable name (`tokens`, `kv`, `time`)."""
    if name == "tokens":
        return TokensCost()
    if name == "kv":
        return KVCost()
    if name == "time":
        return TimeCost(profile if profile is not None else LinearProfile())
    raise ValueError(f"unknown cost model {name!r}; choose from tokens, kv, time")


COST_MODELS = ("tokens", "kv", "time")


def cost_support(
    model: CostModel, prompt_tokens: float, dist: LengthDist, cached_tokens: float = 0.0
) -> FloatArray:
    """The cost distribution's support (same probabilities as `dist`)."""
    return model.cost(prompt_tokens, dist.support, cached_tokens)


def attained_cost(
    model: CostModel, prompt_tokens: float, generated: float, cached_tokens: float = 0.0
) -> float:
    """Cost already spent after `generated` output tokens (0 before the first token).

    A job that has produced nothing has not been prefilled yet either, so even a model with a
    fixed prefill term (`time`) reports nothing spent.
    """
    if generated <= 0:
        return 0.0
    return float(model.cost(prompt_tokens, np.asarray(float(generated)), cached_tokens))
