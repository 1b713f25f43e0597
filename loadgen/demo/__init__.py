"""`sagesched demo`: FCFS vs SageSched through the gateway on an emulated backend.

`run` is the demo (`main`); its child servers are started and always stopped by
`loadgen.procs`. Depends on `loadgen.replay`, `loadgen.traces`, `loadgen.regions` and the
`sagesched` CLI (children run `sagesched emulate` / `sagesched serve`).
"""

from loadgen.demo.run import main

__all__ = ["main"]
