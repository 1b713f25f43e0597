"""The history index: embeddings of completed requests with their true lengths.

An hnswlib cosine index over a ring of `capacity_items` slots. Slot (= hnswlib label) of the
n-th item ever added is n mod capacity, so once full, each new item replaces the oldest one in
place (hnswlib updates an existing label's vector and links). Each slot also holds the item's
output and prompt length in tokens.

Thread-safe: one lock serialises adds and queries (a k=32 query takes ~0.3 ms, so the lock is
never held long). Blocking: call from worker threads when on an event loop.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

SNAPSHOT_FORMAT = "sagesched-predictor-history"
SNAPSHOT_VERSION = 1


class SnapshotError(ValueError):
    """A snapshot file is unreadable, of another format/version, or does not fit this model."""


@dataclass(frozen=True, slots=True)
class Neighbours:
    """Result of one query, best first; all arrays have the same length (maybe 0)."""

    similarity: NDArray[np.float64]
    """Cosine similarity to the query, in [-1, 1]."""
    output_tokens: NDArray[np.float64]
    """True output length of each neighbour, tokens."""
    prompt_tokens: NDArray[np.float64]
    """Prompt length of each neighbour, tokens."""

    def __len__(self) -> int:
        return int(self.similarity.size)


_EMPTY = Neighbours(np.zeros(0), np.zeros(0), np.zeros(0))


class HistoryIndex:
    """Bounded, thread-safe k-NN index of (embedding, output tokens, prompt tokens)."""

    def __init__(
        self,
        dim: int,
        capacity_items: int = 100_000,
        *,
        m: int = 16,
        ef_construction: int = 100,
        ef_search: int = 64,
    ) -> None:
        import hnswlib

        self.dim = dim
        self.capacity = capacity_items
        self.m, self.ef_construction, self.ef_search = m, ef_construction, ef_search
        self._index = hnswlib.Index(space="cosine", dim=dim)
        self._index.init_index(max_elements=capacity_items, ef_construction=ef_construction, M=m)
        self._index.set_ef(ef_search)
        self._output = np.zeros(capacity_items, dtype=np.float64)
        self._prompt = np.zeros(capacity_items, dtype=np.float64)
        self._added = 0  # items ever added; the next slot is _added % capacity
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return min(self._added, self.capacity)

    @property
    def added(self) -> int:
        """Items ever added (including those since replaced)."""
        return self._added

    def add(self, vectors: ArrayLike, output_tokens: ArrayLike, prompt_tokens: ArrayLike) -> None:
        """Add items (one row each); beyond capacity the oldest are replaced."""
        x = np.ascontiguousarray(vectors, dtype=np.float32).reshape(-1, self.dim)
        out = np.asarray(output_tokens, dtype=np.float64).ravel()
        prm = np.asarray(prompt_tokens, dtype=np.float64).ravel()
        if not (x.shape[0] == out.size == prm.size):
            raise ValueError("one output and one prompt length per vector")
        skip = max(x.shape[0] - self.capacity, 0)  # only the newest `capacity` can survive
        x, out, prm = x[skip:], out[skip:], prm[skip:]
        with self._lock:
            start = self._added + skip
            slots = (start + np.arange(x.shape[0])) % self.capacity
            self._index.add_items(x, slots)
            self._output[slots] = out
            self._prompt[slots] = prm
            self._added = start + x.shape[0]

    def query(self, vector: ArrayLike, k: int, similarity_floor: float = -1.0) -> Neighbours:
        """Up to `k` nearest items with similarity ≥ `similarity_floor`, best first."""
        return self.query_many(np.asarray(vector).reshape(1, -1), k, similarity_floor)[0]

    def query_many(
        self, vectors: ArrayLike, k: int, similarity_floor: float = -1.0
    ) -> list[Neighbours]:
        """`query` for each row of `vectors` (one hnswlib call: used by offline evaluation)."""
        x = np.ascontiguousarray(vectors, dtype=np.float32).reshape(-1, self.dim)
        with self._lock:
            kk = min(k, len(self))
            if kk == 0:
                return [_EMPTY] * x.shape[0]
            ef = max(self.ef_search, kk)
            while True:
                self._index.set_ef(ef)
                try:
                    labels, dist = self._index.knn_query(
                        x, k=kk, num_threads=1 if len(x) == 1 else -1
                    )
                    break
                except RuntimeError:
                    # hnswlib reached fewer than kk items (its graph, rewired as slots are
                    # overwritten, can leave some unreachable): search wider, then ask for
                    # fewer; a prediction never fails for it
                    if ef < len(self):
                        ef = min(len(self), 4 * ef)
                    elif kk > 1:
                        kk //= 2
                    else:
                        return [_EMPTY] * x.shape[0]
            outs, prms = self._output[labels], self._prompt[labels]
        sims = 1.0 - dist.astype(np.float64)
        result = []
        for s, o, p in zip(sims, outs, prms, strict=True):
            keep = s >= similarity_floor
            result.append(Neighbours(s[keep], o[keep], p[keep]))
        return result

    def recent(self, n: int) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        """Output and prompt lengths (tokens) of the `n` most recently added items, newest
        first (fewer when fewer are held)."""
        with self._lock:
            n = min(n, len(self))
            slots = (self._added - 1 - np.arange(n)) % self.capacity
            return self._output[slots].copy(), self._prompt[slots].copy()

    def items_in_order(
        self,
    ) -> tuple[NDArray[np.float32], NDArray[np.float64], NDArray[np.float64]]:
        """Every held item, oldest first: (embeddings, output tokens, prompt tokens). Used to
        retrain the online models after loading a snapshot that has none."""
        with self._lock:
            n = len(self)
            slots = (self._added - n + np.arange(n)) % self.capacity
            if n == 0:
                return np.zeros((0, self.dim), np.float32), np.zeros(0), np.zeros(0)
            vectors = np.asarray(self._index.get_items(slots), dtype=np.float32)
            return vectors, self._output[slots].copy(), self._prompt[slots].copy()

    # -- persistence ------------------------------------------------------------------

    def to_arrays(self, prefix: str) -> tuple[dict[str, Any], dict[str, NDArray[Any]]]:
        """(JSON-able header, arrays) of this index, array names prefixed (a snapshot member
        set; `from_arrays` inverts it)."""
        with _scratch(Path(tempfile.gettempdir()), "sagesched-hnsw") as tmp:
            with self._lock:
                self._index.save_index(str(Path(tmp) / "index.bin"))
                header = {
                    "dim": self.dim,
                    "capacity_items": self.capacity,
                    "added": self._added,
                    "m": self.m,
                    "ef_construction": self.ef_construction,
                }
                output, prompt = self._output.copy(), self._prompt.copy()
            graph = np.fromfile(Path(tmp) / "index.bin", dtype=np.uint8)
        return header, {
            f"{prefix}output": output,
            f"{prefix}prompt": prompt,
            f"{prefix}graph": graph,
        }

    @classmethod
    def from_arrays(
        cls,
        header: dict[str, Any],
        arrays: dict[str, NDArray[Any]],
        prefix: str,
        *,
        dim: int,
        ef_search: int = 64,
        source: str = "snapshot",
    ) -> HistoryIndex:
        """Inverse of `to_arrays`; `SnapshotError` when the embedding dimension is not `dim`."""
        if header["dim"] != dim:
            raise SnapshotError(
                f"{source} holds {header['dim']}-d embeddings but the embedder makes "
                f"{dim}-d ones (another embedding model?); rebuild it with `warm`"
            )
        self = cls(
            dim,
            int(header["capacity_items"]),
            m=int(header["m"]),
            ef_construction=int(header["ef_construction"]),
            ef_search=ef_search,
        )
        with _scratch(Path(tempfile.gettempdir()), "sagesched-hnsw") as tmp:
            arrays[f"{prefix}graph"].tofile(Path(tmp) / "index.bin")
            self._index.load_index(str(Path(tmp) / "index.bin"), max_elements=self.capacity)
        self._index.set_ef(ef_search)
        self._output[:] = arrays[f"{prefix}output"]
        self._prompt[:] = arrays[f"{prefix}prompt"]
        self._added = int(header["added"])
        return self

    def save(self, path: str | os.PathLike[str], extra: dict[str, Any] | None = None) -> None:
        """Write a snapshot atomically: temp file in the same folder, fsync, rename, fsync
        folder. `extra` (JSON-able) is stored in the header; see `read_header`."""
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        with _scratch(target.parent, f".{target.name}.hnsw") as tmp:
            with self._lock:
                self._index.save_index(str(Path(tmp) / "index.bin"))
                header = {
                    "format": SNAPSHOT_FORMAT,
                    "version": SNAPSHOT_VERSION,
                    "dim": self.dim,
                    "capacity_items": self.capacity,
                    "added": self._added,
                    "m": self.m,
                    "ef_construction": self.ef_construction,
                    "extra": extra or {},
                }
                output, prompt = self._output.copy(), self._prompt.copy()
            graph = np.fromfile(Path(tmp) / "index.bin", dtype=np.uint8)
            part = Path(tmp) / "snapshot.npz"
            with open(part, "wb") as f:
                np.savez(f, header=_json_bytes(header), output=output, prompt=prompt, graph=graph)
                f.flush()
                os.fsync(f.fileno())
            os.replace(part, target)
        _fsync_dir(target.parent)

    @classmethod
    def load(
        cls, path: str | os.PathLike[str], *, dim: int, ef_search: int = 64
    ) -> tuple[HistoryIndex, dict[str, Any]]:
        """Read a (version 1, one index) snapshot; returns the index and the header's
        `extra`. Raises `SnapshotError` on another format or version, or an embedding
        dimension ≠ `dim`."""
        header, arrays = _read(Path(path))
        self = cls.from_arrays(
            header, arrays, "", dim=dim, ef_search=ef_search, source=f"snapshot {path}"
        )
        return self, dict(header["extra"])


def read_header(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON header of a snapshot (format, version, dim, capacity_items, added, extra)."""
    return _read(Path(path), header_only=True)[0]


def _json_bytes(obj: dict[str, Any]) -> NDArray[np.uint8]:
    return np.frombuffer(json.dumps(obj, sort_keys=True).encode(), dtype=np.uint8)


def _read(path: Path, header_only: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    try:
        with np.load(path, allow_pickle=False) as z:
            header = json.loads(z["header"].tobytes().decode())
            if not isinstance(header, dict) or header.get("format") != SNAPSHOT_FORMAT:
                raise SnapshotError(f"{path} is not a predictor history snapshot")
            if header.get("version") != SNAPSHOT_VERSION:
                raise SnapshotError(
                    f"{path} is snapshot version {header.get('version')}; this build reads "
                    f"version {SNAPSHOT_VERSION}"
                )
            arrays = {} if header_only else {k: z[k] for k in ("output", "prompt", "graph")}
    except (OSError, KeyError, ValueError) as exc:
        if isinstance(exc, SnapshotError):
            raise
        raise SnapshotError(f"cannot read predictor snapshot {path}: {exc}") from exc
    return header, arrays


def atomic_savez(path: str | os.PathLike[str], arrays: dict[str, NDArray[Any]]) -> None:
    """Write an .npz atomically: temp file in the same folder, fsync, rename, fsync folder
    (a crash leaves either the old or the new file)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    with _scratch(target.parent, f".{target.name}.snap") as tmp:
        part = Path(tmp) / "snapshot.npz"
        with open(part, "wb") as f:
            np.savez(f, **arrays)  # type: ignore[arg-type]
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, target)
    _fsync_dir(target.parent)


def json_member(obj: dict[str, Any]) -> NDArray[np.uint8]:
    """A JSON object as a uint8 snapshot member (no pickle)."""
    return _json_bytes(obj)


def clean_stale(path: str | os.PathLike[str]) -> int:
    """Remove the temporary folders that saves of the snapshot `path` left behind when their
    process was killed (SIGKILL mid-save); the number removed. Every save does it, and the
    gateway at start (`gateway.prediction.predict`)."""
    target = Path(path)
    removed = 0
    for stem in (f".{target.name}.snap", f".{target.name}.hnsw"):
        removed += _remove_dead(target.parent, stem)
    return removed


def _scratch(folder: Path, stem: str) -> tempfile.TemporaryDirectory[str]:
    """A temporary folder `<stem>-<pid>-<random>` in `folder`, after removing those of the
    same stem left by processes that no longer run (a save killed by SIGKILL leaves its
    folder behind; the target itself is never half-written: the rename is atomic). A live
    process's folder is never touched: two processes may save side by side."""
    _remove_dead(folder, stem)
    return tempfile.TemporaryDirectory(dir=folder, prefix=f"{stem}-{os.getpid()}-")


def _remove_dead(folder: Path, stem: str) -> int:
    pattern = re.compile(re.escape(stem) + r"-(\d+)-")
    removed = 0
    with contextlib.suppress(FileNotFoundError), os.scandir(folder) as entries:
        for entry in entries:
            m = pattern.match(entry.name)
            if m and entry.is_dir(follow_symlinks=False) and not _alive(int(m.group(1))):
                shutil.rmtree(entry.path, ignore_errors=True)
                removed += 1
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
