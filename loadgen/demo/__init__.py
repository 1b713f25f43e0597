"""`sagesched demo`: FCFS vs SageSched through the gateway on an emulated backend.

`run` is the demo (`main`); `procs` starts child servers in their own process groups and
always stops them. Depends on `loadgen.replay`, `loadgen.traces`, `loadgen.regions` and the
`sagesched` CLI (children run `sagesched emulate` / `sagesched serve`).
"""

from loadgen.demo.run import main

__all__ = ["main"]
