"""The simulator: the gateway queue (any `policies` policy through `policies.Scheduler`) in
front of the engine model, in virtual time; `replicas`: several gateway replicas, each its own
queue, in front of several engines. Dependency rule: imports `policies`, `loadgen.engine` and
`loadgen.metrics`; never `gateway`.
"""

from loadgen.sim.replicas import Replicas, simulate_replicas
from loadgen.sim.simulator import Contender, SimResult, contender_names, resolve, simulate

__all__ = [
    "Contender",
    "Replicas",
    "SimResult",
    "contender_names",
    "resolve",
    "simulate",
    "simulate_replicas",
]
