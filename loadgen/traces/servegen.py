"""Alibaba ServeGen client descriptions (alibaba/ServeGen, Apache-2.0) → synthesised requests.

Sources `servegen-language` (`language/m-large`), `servegen-reason` (`reason/deepseek-r1`)
and `servegen-multimodal` (`multimodal/mm-image`), read from
`traces/alibaba/servegen/<category>/<model>/` in the shared folder, or from `path` (a folder
of `chunk-<i>-trace.csv[.gz]` / `chunk-<i>-dataset.json[.gz]` files, e.g. ServeGen's m-mid).

These are per-client descriptions, not per-request traces (the per-request Bailian logs are not
public in a shippable form). Client i has, per 600 s slot, `timestamp_s, rate_rps, cv,
iat_dist, arg1, arg2` (trace CSV), and per 6 h a table of PMFs of its lengths (dataset JSON,
values parsed with `ast.literal_eval`). Like ServeGen's own loader we use only clients that
have both files (m-large: 147 of 162).

Synthesis (seeded, reproducible; numpy PCG64 streams keyed by (seed, slot, client)):
- arrivals: per client and slot, a renewal process from `loadgen.traces.arrivals` with the
  slot's rate and CV (family from `iat_dist`, moment-matched), on the description's clock;
- lengths: each request draws its fields independently from the client's PMFs of the latest
  dataset entry at or before its slot: `prompt_tokens` = input_tokens (language, reason) or
  text + image + audio + video tokens (multimodal); `output_tokens` = output_tokens (reason:
  includes the reasoning tokens; `reason_ratio` is not used). Both at least 1;
- `tenant` = the client (`chunk-<i>`); all clients are merged in time order (ties: client).
A slot's synthesis does not depend on how much of it is asked for.

Windows: the seeded stride sampler (`loadgen.traces.windows.stride_starts`) picks `count`
(default 4) slots among those with a positive summed rate; each window is the first
`n_requests` synthesised requests from that slot's start on (spilling into later slots if
needed). `load_requests` returns the first slot (600 s) synthesised with seed 0.
"""

from __future__ import annotations

import ast
import bisect
import csv
import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from loadgen.schema import TraceRequest, Window
from loadgen.traces import frozen
from loadgen.traces.arrivals import renewal_arrivals
from loadgen.traces.registry import (
    SourceInfo,
    TraceDataMissing,
    open_text,
    register_source,
    shared_file,
)
from loadgen.traces.windows import SAMPLER, rebase, stride_starts, window_id

SLOT_S = 600.0
"""Length of one ServeGen rate window (s)."""
DEFAULT_COUNT = 4
"""Windows taken when `load_windows` gets no count."""
SYNTHESIS = "servegen_moment_matched_v1"
"""Name of the synthesis recipe, recorded in window meta."""

CATEGORIES: dict[str, str] = {
    "language": "traces/alibaba/servegen/language/m-large",
    "reason": "traces/alibaba/servegen/reason/deepseek-r1",
    "multimodal": "traces/alibaba/servegen/multimodal/mm-image",
}
"""Category → folder under the shared data folder."""

PROMPT_FIELDS = ("input_tokens", "text_tokens", "image_tokens", "audio_tokens", "video_tokens")
"""PMF fields summed into `prompt_tokens` (whichever the dataset has)."""

_CHUNK = re.compile(r"^chunk-(\d+)-(trace\.csv|dataset\.json)(\.gz)?$")


@dataclass(frozen=True, slots=True)
class Client:
    """One ServeGen client: its rate slots and (lazily parsed) length tables."""

    name: str
    """`chunk-<i>`."""
    slot_start_s: np.ndarray
    rate_rps: np.ndarray
    cv: np.ndarray
    iat_dist: tuple[str, ...]
    dataset: dict[float, dict[str, str]]
    """Dataset start (s) → field → PMF literal (unparsed)."""

    def tables_at(self, t_s: float) -> dict[str, str] | None:
        """The PMF literals of the latest dataset entry at or before `t_s`."""
        starts = sorted(self.dataset)
        i = bisect.bisect_right(starts, t_s) - 1
        return self.dataset[starts[max(i, 0)]] if starts else None


def pmf_items(literal: str) -> tuple[np.ndarray, np.ndarray]:
    """(values, probabilities) of a ServeGen PMF literal `{value: prob, ...}`.

    The literals hold numbers only, so a split is enough and ~50x faster than
    `ast.literal_eval` on tables of thousands of entries; anything else falls back to it.
    """
    body = literal.strip()
    if body.startswith("{") and body.endswith("}"):
        body = body[1:-1].strip()
        if not body:
            return np.empty(0), np.empty(0)
        try:
            flat = np.array(body.replace(":", ",").split(","), dtype=float)
        except ValueError:
            flat = None
        if flat is not None and flat.size % 2 == 0:
            return flat[0::2], flat[1::2]
    table: dict[float, float] = ast.literal_eval(literal)
    return np.array(list(table), dtype=float), np.array(list(table.values()), dtype=float)


@lru_cache(maxsize=16384)
def parse_pmf(literal: str) -> tuple[np.ndarray, np.ndarray]:
    """(values, cumulative probabilities normalised to end at 1) of a PMF literal."""
    values, probs = pmf_items(literal)
    if values.size == 0 or probs.sum() <= 0:
        return np.zeros(1), np.ones(1)
    cdf = np.cumsum(probs)
    return values, cdf / cdf[-1]


def _sample(rng: np.random.Generator, literal: str, n: int) -> np.ndarray:
    values, cdf = parse_pmf(literal)
    idx = np.minimum(np.searchsorted(cdf, rng.random(n), side="right"), values.size - 1)
    return values[idx]


def _read_rates(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple[str, ...]]:
    starts, rates, cvs, dists = [], [], [], []
    with open_text(path) as f:
        for row in csv.reader(f):
            if not row:
                continue
            starts.append(float(row[0]))
            rates.append(float(row[1]))
            cvs.append(float(row[2]))
            dists.append(row[3].strip())
    return np.array(starts), np.array(rates), np.array(cvs), tuple(dists)


@lru_cache(maxsize=8)
def read_clients(folder: Path) -> tuple[Client, ...]:
    """The clients of a ServeGen model folder that have both files, by chunk number."""
    files: dict[int, dict[str, Path]] = {}
    for p in folder.iterdir():
        m = _CHUNK.match(p.name)
        if m:
            files.setdefault(int(m.group(1)), {})[m.group(2)] = p
    clients = []
    for i in sorted(files):
        if len(files[i]) < 2:
            continue
        with open_text(files[i]["dataset.json"]) as f:
            dataset = {float(k): v for k, v in json.load(f).items()}
        clients.append(Client(f"chunk-{i}", *_read_rates(files[i]["trace.csv"]), dataset))
    if not clients:
        raise TraceDataMissing(f"no ServeGen chunk-<i>-trace/dataset file pairs in {folder}")
    return tuple(clients)


def _slot_arrays(
    clients: tuple[Client, ...], slot: int, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(times s, prompt, output, client index) of every request synthesised in `slot`."""
    parts = []
    for ci, c in enumerate(clients):
        if slot >= c.rate_rps.size or c.rate_rps[slot] <= 0:
            continue
        start = float(c.slot_start_s[slot])
        tables = c.tables_at(start)
        if tables is None or "output_tokens" not in tables:
            continue
        rng = np.random.default_rng([seed, slot, ci])
        t = start + renewal_arrivals(
            rng, c.iat_dist[slot], float(c.rate_rps[slot]), float(c.cv[slot]), SLOT_S
        )
        prompt = sum(
            (_sample(rng, tables[f], t.size) for f in PROMPT_FIELDS if f in tables),
            start=np.zeros(t.size),
        )
        output = _sample(rng, tables["output_tokens"], t.size)
        parts.append((t, prompt, output, np.full(t.size, ci)))
    if not parts:
        return np.empty(0), np.empty(0), np.empty(0), np.empty(0, dtype=int)
    t, p, o, c_idx = (np.concatenate(x) for x in zip(*parts, strict=True))
    order = np.lexsort((c_idx, t))
    return t[order], p[order], o[order], c_idx[order]


def _to_requests(
    source: str, clients: tuple[Client, ...], arrays: tuple[np.ndarray, ...], limit: int | None
) -> list[TraceRequest]:
    """The first `limit` (None: all) synthesised requests as records."""
    t, p, o, c_idx = (a[:limit] for a in arrays)
    return [
        TraceRequest(
            arrival_s=float(t[i]),
            prompt_tokens=max(1, round(float(p[i]))),
            output_tokens=max(1, round(float(o[i]))),
            source=source,
            tenant=clients[int(c_idx[i])].name,
        )
        for i in range(t.size)
    ]


def n_slots(clients: tuple[Client, ...]) -> int:
    """Number of 600 s slots the description covers."""
    return max(c.rate_rps.size for c in clients)


def active_slots(clients: tuple[Client, ...]) -> list[int]:
    """Slots in which at least one client has a positive rate."""
    total = np.zeros(n_slots(clients))
    for c in clients:
        total[: c.rate_rps.size] += c.rate_rps
    return [int(i) for i in np.flatnonzero(total > 0)]


def synthesize(
    source: str, clients: tuple[Client, ...], *, first_slot: int, seed: int, n_requests: int
) -> list[TraceRequest]:
    """The first `n_requests` synthesised requests from the start of `first_slot` on."""
    out: list[TraceRequest] = []
    for slot in range(first_slot, n_slots(clients)):
        arrays = _slot_arrays(clients, slot, seed)
        out += _to_requests(source, clients, arrays, n_requests - len(out))
        if len(out) >= n_requests:
            break
    return out


class ServeGenSource:
    """One ServeGen category, synthesised."""

    def __init__(self, category: str) -> None:
        self.category = category
        self.info = SourceInfo(
            f"servegen-{category}",
            f"Alibaba ServeGen {CATEGORIES[category].rsplit('/', 1)[-1]} client "
            "descriptions, synthesised per request (seeded)",
            "synthetic",
        )

    def resolve(self, path: Path | None) -> Path:
        """The model folder: `path`, else the shared copy (`TraceDataMissing` if absent)."""
        if path is not None:
            if not path.is_dir():
                raise TraceDataMissing(f"{self.info.name}: folder {path} not found")
            return path
        return shared_file(CATEGORIES[self.category])

    def clients(self, path: Path | None) -> tuple[Client, ...]:
        """The parsed client descriptions (cached per folder)."""
        return read_clients(self.resolve(path).resolve())

    def load_requests(self, path: Path | None) -> list[TraceRequest]:
        """Every request of the first slot (600 s from t = 0) synthesised with seed 0."""
        clients = self.clients(path)
        return _to_requests(self.info.name, clients, _slot_arrays(clients, 0, 0), None)

    def load_windows(
        self, *, n_requests: int, count: int | None, seed: int, path: Path | None
    ) -> list[Window]:
        """Windows starting at seeded stride-sampled active slots (see module docstring)."""
        count = DEFAULT_COUNT if count is None else count
        try:
            clients = self.clients(path)
        except TraceDataMissing:
            if path is None and frozen.matches(self.info.name, n_requests, count, seed):
                return frozen.read_frozen(self.info.name)
            raise
        active = active_slots(clients)
        picks = stride_starts(len(active), 1, count, seed)
        windows = []
        for i, pick in enumerate(picks):
            slot = active[pick]
            reqs = synthesize(
                self.info.name, clients, first_slot=slot, seed=seed, n_requests=n_requests
            )
            meta = {"sampler": SAMPLER, "seed": seed, "slot": slot, "synthesis": SYNTHESIS}
            wid = window_id(self.info.name, seed, i)
            windows.append(Window(self.info.name, wid, rebase(reqs), meta))
        return windows


for _category in CATEGORIES:
    register_source(ServeGenSource(_category))
