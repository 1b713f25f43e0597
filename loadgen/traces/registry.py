"""The trace-source registry: stable names to readers, and where the data lives.

Every reader module registers its sources with `@register_source(SourceInfo(...))` on a
`Source` implementation; registering a name twice is an error. The CLI, tests and studies
iterate this registry, never a hand-written list.

Data locations:
- the shared data folder (`shared_data_dir()`): `$SAGESCHED_SHARED_DATA`, else
  `<repo root>/../shared/data`. Nothing is ever downloaded; readers that need a file there
  raise `TraceDataMissing` naming the path and the variable;
- the frozen windows shipped inside the package (`package_data_dir()`, `loadgen/data/`).
"""

from __future__ import annotations

import gzip
import lzma
import os
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Protocol, TypeVar

from loadgen.schema import TraceRequest, Window

SHARED_DATA_ENV = "SAGESCHED_SHARED_DATA"
"""Environment variable that overrides the shared data folder."""


class TraceDataMissing(FileNotFoundError):
    """A reader needs a file that is not there (shared data folder or a user path)."""


def shared_data_dir() -> Path:
    """The shared data folder: `$SAGESCHED_SHARED_DATA`, else `<repo root>/../shared/data`.

    The folder may not exist; readers check the files they need with `shared_file`.
    """
    env = os.environ.get(SHARED_DATA_ENV)
    if env:
        return Path(env)
    repo_root = Path(__file__).resolve().parents[2]
    return repo_root.parent / "shared" / "data"


def shared_file(relative: str) -> Path:
    """A file under the shared data folder; `TraceDataMissing` if it is not there."""
    path = shared_data_dir() / relative
    if not path.exists():
        raise TraceDataMissing(
            f"trace file {path} not found; point ${SHARED_DATA_ENV} at the shared data folder "
            f"(currently {shared_data_dir()}) or pass an explicit path"
        )
    return path


def user_file(path: Path | None, source: str, what: str) -> Path:
    """The user-supplied `path`, checked; for sources whose data is not shipped or shared."""
    if path is None:
        raise TraceDataMissing(
            f"source {source!r} needs a path to {what} (not shipped; nothing downloads)"
        )
    if not path.exists():
        raise TraceDataMissing(f"source {source!r}: {path} not found")
    return path


def open_text(path: Path) -> IO[str]:
    """Open a text file, decompressing `.gz` / `.xz` by suffix."""
    if path.suffix == ".gz":
        return gzip.open(path, "rt", newline="")
    if path.suffix == ".xz":
        return lzma.open(path, "rt", newline="")
    return path.open(newline="")


def package_data_dir() -> Path:
    """`loadgen/data/`: the frozen windows shipped with the package."""
    return Path(__file__).resolve().parents[1] / "data"


@dataclass(frozen=True, slots=True)
class SourceInfo:
    """What a registered source is and what it needs."""

    name: str
    """Stable name (CLI, manifests, `TraceRequest.source`), e.g. `azure-conv-2023`."""
    description: str
    """One line: what the data is and where it comes from."""
    kind: str
    """`trace` (per-request rows with arrivals), `lengths` (length pairs, no arrivals),
    `synthetic` (synthesised from a published description) or `frozen` (fixed windows)."""
    needs_path: bool = False
    """True when no copy is shared or shipped: the user passes `path`."""
    has_arrivals: bool = True
    """False for length-only sources: `arrival_s` is then the row index (1 s apart)."""


class Source(Protocol):
    """A reader. `path` overrides the default file or folder (`None`: shared/shipped copy)."""

    info: SourceInfo

    def load_requests(self, path: Path | None) -> list[TraceRequest]:
        """Every request of the trace, in arrival order, on the trace's own clock (s)."""
        ...

    def load_windows(
        self, *, n_requests: int, count: int | None, seed: int, path: Path | None
    ) -> list[Window]:
        """`count` windows of `n_requests` consecutive requests, rebased to t = 0."""
        ...


_SOURCES: dict[str, Source] = {}

S = TypeVar("S", bound=Source)


def register_source(source: S) -> S:
    """Add a reader under `source.info.name`; a second registration of a name is an error."""
    name = source.info.name
    if name in _SOURCES:
        raise ValueError(f"trace source {name!r} registered twice")
    if not name or not source.info.description:
        raise ValueError(f"trace source {name!r} needs a name and a description")
    _SOURCES[name] = source
    return source


def registered() -> dict[str, Source]:
    """The registry itself (name → reader), in registration order. Do not mutate."""
    return _SOURCES


def get_source(name: str) -> Source:
    """The reader registered as `name`; `KeyError` listing the known names otherwise."""
    try:
        return _SOURCES[name]
    except KeyError:
        known = ", ".join(sorted(_SOURCES))
        raise KeyError(f"unknown trace source {name!r}; known: {known}") from None
