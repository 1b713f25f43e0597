"""The engine model: iteration-level continuous batching in virtual time.

`profiles` turns one iteration's shape (decodes, their total context, prefill tokens) into
seconds; `configs` names the batching rules (vLLM FCFS, Sarathi, SLAI, ...); `model` is the
engine itself, `prefix_cache` its automatic prefix caching. Dependency rule: imports numpy
and `policies` only. To add a latency profile, subclass `LatencyProfile` in `profiles` and
decorate it with `@register_profile`; to add an engine configuration, call
`register_engine(EngineConfig(name=..., ...))` in `configs`.
"""

from loadgen.engine.configs import EngineConfig, engine_config, engine_names, register_engine
from loadgen.engine.model import Engine, Seq
from loadgen.engine.profiles import LatencyProfile, make_profile, profile_names, register_profile

__all__ = [
    "Engine",
    "EngineConfig",
    "LatencyProfile",
    "Seq",
    "engine_config",
    "engine_names",
    "make_profile",
    "profile_names",
    "register_engine",
    "register_profile",
]
