"""LSSP frozen windows: the portability paper's per-request windows (119 of 120).

Sources `lssp-azure2024` (39 windows; `azure_llm_2024_stage0_w09` could not be read),
`lssp-bailian` (40) and `lssp-burstgpt` (40), 200 requests each, from the paper's real-vLLM
workload manifests (see `shared/data/traces/lssp/SOURCES.md`).

Conventions, as reconstructed in that SOURCES.md:
- `arrival_s` is raw, window-relative trace time (s); the first request of every window is at 0;
- `deadline_s` is the paper's SLO deadline on the same clock (raw `slo_deadline_s`);
- `output_tokens` is the frozen true output (`output_tokens_target`), `predicted_output_tokens`
  the paper's imputed prediction (true × log-normal noise), `prompt_tokens` is `input_tokens`;
- `Window.meta` carries `lambda_ref` and `absolute_load_factor` (floats, digit for digit; the
  paper's knee and its HIGH_PRESSURE factor, 1.5 × lambda_ref) plus the strings
  `evidence_class` and `content_sha256`.

Files: `<stem>_windows.csv` (`.csv` or `.csv.gz`) and `<stem>_requests.csv.gz` or `.csv.xz`.
The package ships a copy in `loadgen/data/lssp/` (requests without `source_record_id` and
`request_index`, xz-compressed); `path` may name a folder holding the shared originals.
"""

from __future__ import annotations

import csv
from collections.abc import Iterator
from pathlib import Path

from loadgen.schema import TraceRequest, Window
from loadgen.traces.registry import (
    SourceInfo,
    TraceDataMissing,
    open_text,
    package_data_dir,
    register_source,
)

WINDOW_REQUESTS = 200
"""Requests per LSSP window."""

LSSP_STEMS: dict[str, str] = {
    "lssp-azure2024": "azure2024",
    "lssp-bailian": "bailian",
    "lssp-burstgpt": "burstgpt",
}
"""Registered source name → file stem in `traces/lssp/`."""

_DESCRIPTIONS = {
    "lssp-azure2024": "LSSP frozen windows, Azure LLM 2024 conv (39 x 200; w09 missing)",
    "lssp-bailian": "LSSP frozen windows, Bailian qwen traceB (40 x 200)",
    "lssp-burstgpt": "LSSP frozen windows, BurstGPT v2.0 without fails (40 x 200)",
}


def _find(folder: Path, names: list[str]) -> Path:
    for name in names:
        if (folder / name).exists():
            return folder / name
    raise TraceDataMissing(f"none of {names} found in {folder}")


def shipped_dir() -> Path:
    """`loadgen/data/lssp/`: the copy that ships with the package."""
    return package_data_dir() / "lssp"


def _rows(path: Path) -> Iterator[dict[str, str]]:
    with open_text(path) as f:
        yield from csv.DictReader(f)


def read_lssp_windows(source: str, folder: Path | None = None) -> list[Window]:
    """All frozen windows of `source` (an `lssp-*` name), in file order.

    `folder`: where `<stem>_windows.csv*` and `<stem>_requests.csv.{gz,xz}` are; default the
    shipped copy. Raises `ValueError` if a window's row count disagrees with its `n_requests`.
    """
    stem = LSSP_STEMS[source]
    folder = shipped_dir() if folder is None else folder
    win_path = _find(folder, [f"{stem}_windows.csv", f"{stem}_windows.csv.gz"])
    req_path = _find(folder, [f"{stem}_requests.csv.gz", f"{stem}_requests.csv.xz"])
    grouped: dict[str, list[TraceRequest]] = {}
    for row in _rows(req_path):
        grouped.setdefault(row["window_id"], []).append(
            TraceRequest(
                arrival_s=float(row["arrival_s"]),
                prompt_tokens=int(row["input_tokens"]),
                output_tokens=int(row["output_tokens"]),
                source=source,
                predicted_output_tokens=int(row["predicted_output_tokens"]),
                deadline_s=float(row["slo_deadline_s"]),
            )
        )
    windows: list[Window] = []
    for w in _rows(win_path):
        wid = w["window_id"]
        requests = grouped.pop(wid, [])
        if len(requests) != int(w["n_requests"]):
            raise ValueError(f"{req_path}: window {wid} has {len(requests)} rows")
        meta = {
            "lambda_ref": float(w["lambda_ref"]),
            "absolute_load_factor": float(w["absolute_load_factor"]),
            "evidence_class": w["evidence_class"],
            "content_sha256": w["content_sha256"],
        }
        windows.append(Window(source, wid, tuple(requests), meta))
    if grouped:
        raise ValueError(f"{req_path}: rows for unlisted windows {sorted(grouped)}")
    return windows


class LsspSource:
    """One `lssp-*` source: frozen windows only (the sampler does not apply)."""

    def __init__(self, name: str) -> None:
        self.info = SourceInfo(name=name, description=_DESCRIPTIONS[name], kind="frozen")

    def load_requests(self, path: Path | None) -> list[TraceRequest]:
        """Every window's requests, concatenated in file order (each window starts at 0 s)."""
        return [r for w in read_lssp_windows(self.info.name, path) for r in w.requests]

    def load_windows(
        self, *, n_requests: int, count: int | None, seed: int, path: Path | None
    ) -> list[Window]:
        """The frozen windows in file order; the first `count` if given. `seed` is ignored."""
        if n_requests != WINDOW_REQUESTS:
            raise ValueError(f"{self.info.name} windows hold {WINDOW_REQUESTS} requests")
        windows = read_lssp_windows(self.info.name, path)
        return windows if count is None else windows[:count]


for _name in LSSP_STEMS:
    register_source(LsspSource(_name))
