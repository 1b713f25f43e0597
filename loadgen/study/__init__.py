"""Studies in simulation: the ranking-portability grid (`--mode lssp`) and SageSched against
its baselines (`--mode sagesched`), run by `sagesched study`.

Dependency rule: imports `loadgen.sim`, `loadgen.metrics`, `loadgen.regions`,
`loadgen.traces`, `policies` and (lazily, for the real predictor) `predictor`; never
`gateway`. Every simulation goes through `loadgen.sim.simulate` and every metric through
`loadgen.metrics`: the study adds statistics and reports, no scheduling or metric logic.
Modules: `grid` (cells, executors, tidy CSV), `stats` (pure statistics), `analysis` (rows →
tables), `report` + `plots`, `sagesched_eval` + `sagesched_report`, `cli`. To study another
policy, register it in `policies` (or an engine configuration) and add it to
`grid.POLICIES` or `sagesched_eval.BASELINES`.
"""
