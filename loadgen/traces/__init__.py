"""Trace readers: every workload source as one normalised schema, plus windows of it.

Each reader turns its files into `loadgen.schema.TraceRequest`s (arrival s, prompt and output
tokens, source, optional tenant/session, optional predicted output and SLO deadline) and cuts
`Window`s of N consecutive requests with the seeded, outcome-blind sampler of
`loadgen.traces.windows`. Sources are registered under stable names:

- `azure-code-2023`, `azure-conv-2023`, `azure-2024` (user path): Azure LLM inference traces;
- `burstgpt-v1`, `burstgpt-v3` (400-row slices), `burstgpt-lengths` (length pairs only);
- `servegen-<category>`: requests synthesised from Alibaba ServeGen client descriptions;
- `bailian-traceb` (user path): the Qwen/Bailian traceB JSONL;
- `lssp-azure2024`, `lssp-bailian`, `lssp-burstgpt`: the portability paper's frozen windows;
- `mooncake-conversation`, `mooncake-synthetic`: Mooncake traces with prompt block hashes.

Dependency rule: standard library and numpy only; nothing downloads. Shared files are found
under `shared_data_dir()` (`$SAGESCHED_SHARED_DATA`); frozen windows ship in `loadgen/data/`.
To add a source: one module with a `Source` implementation registered via `register_source`,
imported below.
"""

from __future__ import annotations

from pathlib import Path

from loadgen.schema import TraceRequest, Window

# Importing a reader module registers its sources (registry order: this import order).
from loadgen.traces import (  # noqa: F401
    azure,
    bailian,
    burstgpt,
    capture,
    frozen,
    lssp,
    mooncake,
    servegen,
)
from loadgen.traces.registry import (
    SHARED_DATA_ENV,
    Source,
    SourceInfo,
    TraceDataMissing,
    get_source,
    package_data_dir,
    register_source,
    registered,
    shared_data_dir,
)


def list_sources() -> list[SourceInfo]:
    """Every registered source, in registration order."""
    return [s.info for s in registered().values()]


def source_names() -> list[str]:
    """Every registered source name, in registration order."""
    return list(registered())


def load_requests(source: str, path: Path | None = None) -> list[TraceRequest]:
    """All requests of `source` in arrival order (the full trace where there is one).

    `path` overrides the shared or shipped file; sources with `needs_path` require it.
    """
    return get_source(source).load_requests(path)


def shipped_windows(source: str) -> list[Window]:
    """The windows shipped inside the package for `source` ([] if none ship).

    `lssp-*`: all frozen windows; sources in `loadgen.traces.frozen.FROZEN_SPEC`: their frozen
    sample. Needs nothing outside the repository.
    """
    get_source(source)  # KeyError for unknown names
    if source in lssp.LSSP_STEMS:
        return lssp.read_lssp_windows(source)
    if frozen.read_manifest_or_none(source) is None:
        return []
    return frozen.read_frozen(source)


def load_windows(
    source: str,
    *,
    n_requests: int = 200,
    count: int | None = None,
    seed: int = 0,
    path: Path | None = None,
) -> list[Window]:
    """Windows of `n_requests` consecutive requests of `source`, rebased to t = 0 s.

    Trace sources use the stratified stride sampler (`loadgen.traces.windows`); `count=None`
    takes `default_count`. `lssp-*` sources return their frozen windows in file order.
    """
    return get_source(source).load_windows(n_requests=n_requests, count=count, seed=seed, path=path)


__all__ = [
    "SHARED_DATA_ENV",
    "Source",
    "SourceInfo",
    "TraceDataMissing",
    "TraceRequest",
    "Window",
    "get_source",
    "list_sources",
    "load_requests",
    "load_windows",
    "package_data_dir",
    "register_source",
    "shared_data_dir",
    "shipped_windows",
    "source_names",
]
