"""The common reader shape: a file-backed full trace, windows cut by the sampler.

`TraceFileSource` resolves the file (user path, else the shared data folder), calls the
format's parse function, and cuts windows with `loadgen.traces.windows.sample_windows`. When
the shared file is absent and the caller asks for exactly the frozen set's parameters, the
windows shipped in `loadgen/data/windows/` are returned instead, so the demo and tests need
nothing outside the repository.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from loadgen.schema import TraceRequest, Window
from loadgen.traces import frozen
from loadgen.traces.registry import SourceInfo, TraceDataMissing, shared_file, user_file
from loadgen.traces.windows import sample_windows

Parser = Callable[[Path, str], list[TraceRequest]]
"""Reads one file into requests in arrival order: (path, source name) → requests."""


class TraceFileSource:
    """A source backed by one trace file."""

    def __init__(self, info: SourceInfo, parse: Parser, shared_path: str | None) -> None:
        """`shared_path`: the file relative to the shared data folder; None if not shared."""
        self.info = info
        self._parse = parse
        self._shared_path = shared_path

    def resolve(self, path: Path | None) -> Path:
        """The file to read: `path` if given, else the shared copy (`TraceDataMissing`)."""
        if path is not None or self._shared_path is None:
            return user_file(path, self.info.name, f"a {self.info.description} file")
        return shared_file(self._shared_path)

    def load_requests(self, path: Path | None) -> list[TraceRequest]:
        """Every request of the file, in arrival order."""
        return self._parse(self.resolve(path), self.info.name)

    def load_windows(
        self, *, n_requests: int, count: int | None, seed: int, path: Path | None
    ) -> list[Window]:
        """Sampled windows; the shipped frozen set if the shared file is absent and it matches."""
        try:
            requests = self.load_requests(path)
        except TraceDataMissing:
            if path is None and frozen.matches(self.info.name, n_requests, count, seed):
                return frozen.read_frozen(self.info.name)
            raise
        return sample_windows(
            self.info.name, requests, n_requests=n_requests, count=count, seed=seed
        )
