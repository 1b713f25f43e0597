"""The simulator: the gateway queue (any `policies` policy through `policies.Scheduler`) in
front of the engine model, in virtual time; `replicas`: several gateway replicas, each its own
queue, in front of several engines; `fleet`: one queue and a router (`policies.routing`) in
front of several engines with prefix caching. Dependency rule: imports `policies`,
`loadgen.engine` and `loadgen.metrics`; never `gateway`.
"""

from loadgen.sim.fleet import Fleet, FleetResult, lru_hit_ratio, simulate_fleet
from loadgen.sim.replicas import Replicas, simulate_replicas
from loadgen.sim.simulator import Contender, SimResult, contender_names, resolve, simulate

__all__ = [
    "Contender",
    "Fleet",
    "FleetResult",
    "Replicas",
    "SimResult",
    "contender_names",
    "lru_hit_ratio",
    "resolve",
    "simulate",
    "simulate_fleet",
    "simulate_replicas",
]
