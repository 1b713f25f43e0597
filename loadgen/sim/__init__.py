"""The simulator: the gateway queue (any `policies` policy through `policies.Scheduler`) in
front of the engine model, in virtual time. Dependency rule: imports `policies`, `loadgen.engine`
and `loadgen.metrics`; never `gateway`.
"""

from loadgen.sim.simulator import Contender, SimResult, contender_names, resolve, simulate

__all__ = ["Contender", "SimResult", "contender_names", "resolve", "simulate"]
