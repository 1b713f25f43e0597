"""The frozen window set shipped in `loadgen/data/windows/`, and its manifests.

For each source in `FROZEN_SPEC`, `write_frozen` takes `load_windows(source, n_requests=,
count=, seed=)` from the shared data and writes
- `<source>.csv.gz`: `window_id, arrival_s, prompt_tokens, output_tokens, tenant, session`
  (floats as `repr`, so they read back bit for bit; empty = None), plus `block_tokens,
  block_hashes` (the chain as space-separated hex) for sources whose requests carry prompt
  block hashes (Mooncake);
- `<source>.manifest.json`: the sampler, its parameters, the input file's SHA-256, and per
  window its id, meta (start index or slot) and `window_digest`.

`read_frozen` rebuilds the exact `Window` objects (meta included). Regenerate with
`sagesched traces --freeze` (needs the shared data folder).
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import io
import json
from pathlib import Path
from typing import Any

from loadgen.schema import TraceRequest, Window
from loadgen.traces.registry import TraceDataMissing, package_data_dir

FROZEN_SPEC: dict[str, tuple[int, int, int]] = {
    "azure-code-2023": (200, 4, 0),
    "azure-conv-2023": (200, 4, 0),
    "burstgpt-v1": (200, 1, 0),
    "burstgpt-v3": (200, 1, 0),
    "servegen-language": (200, 4, 0),
    "servegen-reason": (200, 2, 0),
    "servegen-multimodal": (200, 2, 0),
    "mooncake-conversation": (200, 1, 0),
    "mooncake-synthetic": (200, 1, 0),
}
"""Source → (n_requests, count, seed) of its shipped windows."""

_COLUMNS = ["window_id", "arrival_s", "prompt_tokens", "output_tokens", "tenant", "session"]
_BLOCK_COLUMNS = ["block_tokens", "block_hashes"]


def frozen_dir() -> Path:
    """`loadgen/data/windows/`."""
    return package_data_dir() / "windows"


def matches(source: str, n_requests: int, count: int | None, seed: int) -> bool:
    """True if `source` ships frozen windows taken with exactly these parameters."""
    spec = FROZEN_SPEC.get(source)
    return spec is not None and spec == (n_requests, count, seed)


def read_manifest(source: str) -> dict[str, Any]:
    """The manifest of `source`'s shipped windows; `TraceDataMissing` if none ships."""
    path = frozen_dir() / f"{source}.manifest.json"
    if not path.exists():
        raise TraceDataMissing(f"no frozen windows shipped for {source!r} ({path})")
    manifest: dict[str, Any] = json.loads(path.read_text())
    return manifest


def read_manifest_or_none(source: str) -> dict[str, Any] | None:
    """The manifest of `source`'s shipped windows, or None if none ships."""
    try:
        return read_manifest(source)
    except TraceDataMissing:
        return None


def read_frozen(source: str) -> list[Window]:
    """The shipped windows of `source`, exactly as `write_frozen` took them."""
    manifest = read_manifest(source)
    grouped: dict[str, list[TraceRequest]] = {}
    with gzip.open(frozen_dir() / f"{source}.csv.gz", "rt", newline="") as f:
        for row in csv.DictReader(f):
            grouped.setdefault(row["window_id"], []).append(
                TraceRequest(
                    arrival_s=float(row["arrival_s"]),
                    prompt_tokens=int(row["prompt_tokens"]),
                    output_tokens=int(row["output_tokens"]),
                    source=source,
                    tenant=row["tenant"] or None,
                    session=row["session"] or None,
                    block_hashes=tuple(int(h, 16) for h in row.get("block_hashes", "").split()),
                    block_tokens=int(row.get("block_tokens") or 0),
                )
            )
    return [
        Window(source, w["window_id"], tuple(grouped[w["window_id"]]), dict(w["meta"]))
        for w in manifest["windows"]
    ]


def _file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_frozen(source: str, input_file: Path | None = None) -> list[Window]:
    """Take `source`'s frozen windows from the shared data and write them to `frozen_dir()`.

    `input_file`: the file (or folder) the windows came from, for the manifest's provenance.
    """
    from loadgen.traces.registry import get_source
    from loadgen.traces.windows import SAMPLER, window_digest

    n_requests, count, seed = FROZEN_SPEC[source]
    windows = get_source(source).load_windows(
        n_requests=n_requests, count=count, seed=seed, path=None
    )
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    blocks = any(r.block_tokens for w in windows for r in w.requests)
    writer.writerow(_COLUMNS + _BLOCK_COLUMNS * blocks)
    for w in windows:
        for r in w.requests:
            row = [w.window_id, repr(r.arrival_s), r.prompt_tokens, r.output_tokens]
            row += [r.tenant or "", r.session or ""]
            if blocks:
                row += [r.block_tokens, " ".join(f"{h:x}" for h in r.block_hashes)]
            writer.writerow(row)
    frozen_dir().mkdir(parents=True, exist_ok=True)
    data = gzip.compress(buf.getvalue().encode(), compresslevel=9, mtime=0)
    (frozen_dir() / f"{source}.csv.gz").write_bytes(data)
    provenance: dict[str, Any] = {}
    if input_file is not None and input_file.is_file():
        provenance = {"file": input_file.name, "sha256": _file_sha256(input_file)}
    elif input_file is not None:
        provenance = {"folder": input_file.name}
    manifest = {
        "source": source,
        "sampler": SAMPLER,
        "n_requests": n_requests,
        "count": count,
        "seed": seed,
        "input": provenance,
        "windows": [
            {"window_id": w.window_id, "meta": w.meta, "sha256": window_digest(w)} for w in windows
        ],
    }
    path = frozen_dir() / f"{source}.manifest.json"
    path.write_text(json.dumps(manifest, indent=1) + "\n")
    return windows


def write_frozen_from_shared(source: str) -> list[Window]:
    """`write_frozen` with the shared input file (or folder) recorded as provenance."""
    from loadgen.traces.registry import get_source

    resolve = getattr(get_source(source), "resolve", None)
    return write_frozen(source, resolve(None) if resolve is not None else None)
