"""What-if on your own traffic: the portability grid on windows of a gateway capture.

`sagesched study --mode lssp --trace CAPTURE [--profile P]` asks the study's question of an
operator's traffic (`sagesched serve --capture DIR`, `loadgen.traces.capture`):
- the capture's completed requests are cut into consecutive windows (`--window-requests`,
  200 like the paper's); each gets the paper's imputed fields (REFERENCE.md §2: predicted
  output = true × log-normal noise σ = 0.2, SLO deadline = arrival + 20 × (0.0004 s × prompt
  + 0.02 s × predicted output)) and its own knee on profile P;
- every window runs at the six knee regions and at `MEASURED` (its own clock: the load the
  capture recorded) under the headline policies plus this project's gateway policies;
- a few windows of each public source run the same cells on the same profile, so the report
  can say how the capture's ranking agrees with Azure, Bailian and BurstGPT (τ-b with a
  window-bootstrap CI, supported reversals with the study's test);
- the recommendation is the best policy by mean ANWG at the measured load, with the policies
  whose paired difference from it is not significant, and the best by mean latency.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from loadgen.regions import REGIONS, factor_for_utilisation, find_knee, slo_deadline
from loadgen.schema import TraceRequest, Window
from loadgen.study import analysis, stats
from loadgen.study.grid import (
    AXES,
    GATEWAY_POLICIES,
    HEADLINE_POLICIES,
    MEASURED,
    PRIMARY_METRIC,
    SOURCE_LABELS,
    SOURCES,
    Chunk,
    run_grid,
    windows_of,
)

CAPTURE = "capture"
"""The capture's source name in the rows and tables."""
DEFAULT_PROFILE = "lssp-constant"
"""The paper's engine: the public sources' frozen knees hold on it."""
POLICIES: tuple[str, ...] = (*HEADLINE_POLICIES, *GATEWAY_POLICIES)
"""What the what-if ranks: the study's headline policies and the gateway's own."""
LATENCY = "latency_s_mean"
PREDICTION_SIGMA = 0.2
"""The paper's imputed prediction noise (log-normal σ)."""


def paper_fields(requests: Sequence[TraceRequest], seed: int) -> list[TraceRequest]:
    """`requests` with the paper's imputed prediction and SLO deadline (REFERENCE.md §2)."""
    rng = np.random.default_rng(seed)
    noise = np.exp(rng.normal(0.0, PREDICTION_SIGMA, size=len(requests)))
    out = []
    for r, z in zip(requests, noise, strict=True):
        predicted = max(1, round(r.output_tokens * float(z)))
        deadline = slo_deadline(r.arrival_s, r.prompt_tokens, predicted)
        out.append(dataclasses.replace(r, predicted_output_tokens=predicted, deadline_s=deadline))
    return out


def with_knee(window: Window, profile: str) -> Window:
    """`window` with its knee on `profile` in its meta (the FCFS 0.5% violation point)."""
    knee = find_knee(window.requests, profile=profile)
    return dataclasses.replace(window, meta={**window.meta, "knee": knee})


def capture_windows(
    path: Path, *, n_requests: int = 200, profile: str = DEFAULT_PROFILE, seed: int = 0
) -> list[Window]:
    """Every run of `n_requests` consecutive completed requests of a capture, with the paper's
    imputed fields and a knee on `profile`."""
    from loadgen.traces import load_requests
    from loadgen.traces.windows import rebase

    requests = load_requests(CAPTURE, path=path)
    n = len(requests) // n_requests
    if n == 0:
        raise ValueError(
            f"{path}: {len(requests)} completed requests, fewer than one window of {n_requests} "
            "(lower --window-requests or capture longer)"
        )
    out = []
    for i in range(n):
        part = paper_fields(rebase(requests[i * n_requests : (i + 1) * n_requests]), seed + i)
        w = Window(CAPTURE, f"capture_w{i:03d}", tuple(part), {"start_index": i * n_requests})
        out.append(with_knee(w, profile))
    return out


def public_windows(n_per_source: int, profile: str) -> list[Window]:
    """The first `n_per_source` frozen windows of each public source; re-kneed on `profile`
    unless it is the paper's (whose frozen knees they carry)."""
    out = []
    for source in SOURCES:
        for w in windows_of(source)[:n_per_source]:
            out.append(w if profile == DEFAULT_PROFILE else with_knee(w, profile))
    return out


def plan(
    captured: Sequence[Window],
    public: Sequence[Window],
    *,
    regions: Sequence[str],
    policies: Sequence[str],
    profile: str,
) -> list[Chunk]:
    """One chunk per window; the capture's also run at its measured load."""
    chunks = []
    for w in captured:
        points = (*regions, MEASURED)
        chunks.append(Chunk(CAPTURE, 0, "knee", points, tuple(policies), w, profile))
    for w in public:
        chunks.append(Chunk(w.source, 0, "knee", tuple(regions), tuple(policies), w, profile))
    return chunks


@dataclasses.dataclass(slots=True)
class Standing:
    """One policy at one load point of the capture (values in their own units)."""

    policy: str
    anwg: stats.Estimate
    latency_s: stats.Estimate
    tied_anwg: bool
    """The paired bootstrap CI of (best − this) on ANWG includes 0."""
    tied_latency: bool
    """The same against the policy with the lowest mean latency."""


def _ties(boot: np.ndarray, best: int) -> np.ndarray:
    """Per policy: whether the paired CI of (best − it) includes 0 (oriented values)."""
    diff = boot[:, [best]] - boot
    with np.errstate(invalid="ignore"):
        lo = np.nanpercentile(diff, 2.5, axis=0)
    out: np.ndarray = ~(lo > 0)
    return out


def standings(grid: analysis.Grid, region: str, *, n_boot: int = stats.N_BOOT) -> list[Standing]:
    """The capture's policies at `region`, best ANWG first (ties by lower mean latency)."""
    anwg = grid.get("knee", CAPTURE, region, PRIMARY_METRIC)
    lat = grid.get("knee", CAPTURE, region, LATENCY)  # oriented: −seconds
    rng = np.random.default_rng(stats.SEED)
    idx = stats.boot_indices(anwg.shape[0], n_boot, rng)
    boot_a = stats.boot_means(anwg, idx)
    boot_l = stats.boot_means(lat, idx)
    means_a = np.nan_to_num(stats.policy_means(anwg), nan=-math.inf)
    means_l = np.nan_to_num(stats.policy_means(lat), nan=-math.inf)
    order = sorted(range(len(grid.policies)), key=lambda j: (-means_a[j], -means_l[j]))
    tied_a = _ties(boot_a, order[0])
    tied_l = _ties(boot_l, int(np.argmax(means_l)))
    return [
        Standing(
            grid.policies[j],
            stats.interval(boot_a[:, j], float(means_a[j])),
            stats.interval(-boot_l[:, j], float(-means_l[j])),
            bool(tied_a[j]),
            bool(tied_l[j]),
        )
        for j in order
    ]


@dataclasses.dataclass(slots=True)
class Agreement:
    """How the capture's ranking at one region agrees with one public source's."""

    region: str
    source: str
    tau: stats.Estimate
    supported: list[stats.PairTest]
    """Policy pairs whose order flips between the capture and the source (the study's
    supported practical reversals: 10% margin, both CIs excluding 0, BH q = 0.05)."""


def agreements(
    grid: analysis.Grid, regions: Sequence[str], *, n_boot: int = stats.N_BOOT
) -> list[Agreement]:
    """τ-b and supported reversals of the capture against every public source, per region."""
    out = []
    for region in regions:
        mine = grid.get("knee", CAPTURE, region, PRIMARY_METRIC)
        for source in grid.sources:
            if source == CAPTURE:
                continue
            theirs = grid.get("knee", source, region, PRIMARY_METRIC)
            tau = stats.tau_between(mine, theirs, n_boot=n_boot)
            tests = stats.pair_tests(mine, theirs, grid.policies, n_boot=n_boot)
            classes = stats.classify(tests)
            supported = [
                t for t, c in zip(tests, classes, strict=True) if c == "supported_practical"
            ]
            out.append(Agreement(region, source, tau, supported))
    return out


def measured_load(captured: Sequence[Window]) -> float:
    """The capture's recorded arrival rate as a multiple of its knee's (geometric mean over
    windows): 1 / knee, since the knee is the factor that speeds the recorded clock up."""
    return math.exp(np.mean([-math.log(float(w.meta["knee"])) for w in captured]))


def measured_utilisation(captured: Sequence[Window], profile: str) -> float:
    """Offered decode work over the engine's token capacity at the recorded clock (mean over
    windows; `loadgen.regions.factor_for_utilisation`)."""
    return float(
        np.mean([1.0 / factor_for_utilisation(w.requests, 1.0, profile=profile) for w in captured])
    )


def nearest_region(multiple: float) -> str:
    """The knee region closest (in log) to a load multiple."""
    return min(REGIONS, key=lambda r: abs(math.log(REGIONS[r]) - math.log(multiple)))


def run_whatif(
    trace: Path,
    out: Path,
    *,
    profile: str = DEFAULT_PROFILE,
    window_requests: int = 200,
    public_per_source: int = 10,
    regions: Sequence[str] | None = None,
    policies: Sequence[str] = POLICIES,
    executor: str = "process",
    workers: int | None = None,
    n_boot: int = stats.N_BOOT,
    progress: bool = True,
) -> dict[str, Any]:
    """Simulate, analyse and write `out/report.md` and `out/whatif.csv.gz`; return a summary."""
    from loadgen.study.grid import write_rows
    from loadgen.traces.capture import capture_summary

    points = tuple(regions or AXES["knee"])
    unknown = set(points) - set(REGIONS)
    if unknown:
        raise ValueError(f"unknown regions {sorted(unknown)}; known: {list(REGIONS)}")
    bad = set(policies) - set(POLICIES)
    if bad:
        raise ValueError(f"unknown policies {sorted(bad)}; known: {list(POLICIES)}")
    captured = capture_windows(trace, n_requests=window_requests, profile=profile)
    public = public_windows(public_per_source, profile)
    chunks = plan(captured, public, regions=points, policies=policies, profile=profile)
    rows = run_grid(chunks, executor=executor, workers=workers, progress=progress)
    write_rows(rows, out / "whatif.csv.gz")
    grid = analysis.build(rows, tuple(policies), sources=(CAPTURE, *SOURCES))
    load = measured_load(captured)
    at_load = standings(grid, MEASURED, n_boot=n_boot)
    by_region = {r: standings(grid, r, n_boot=n_boot) for r in points}
    agree = agreements(grid, points, n_boot=n_boot)
    summary: dict[str, Any] = {
        "trace": str(trace),
        "profile": profile,
        "capture": capture_summary(trace),
        "windows": [w.window_id for w in captured],
        "knees": [float(w.meta["knee"]) for w in captured],
        "public_windows_per_source": public_per_source,
        "policies": list(policies),
        "n_boot": n_boot,
        "measured_load_x_knee": load,
        "measured_utilisation": measured_utilisation(captured, profile),
        "nearest_region": nearest_region(load),
        "recommended": at_load[0].policy,
        "tied_with_recommended": [s.policy for s in at_load[1:] if s.tied_anwg],
        "best_mean_latency": (fastest := min(at_load, key=lambda s: s.latency_s.value)).policy,
        "tied_with_best_latency": [
            s.policy for s in at_load if s.tied_latency and s is not fastest
        ],
        "ranking": {
            r: [s.policy for s in st] for r, st in (*by_region.items(), (MEASURED, at_load))
        },
        "tau": {f"{a.region}|{a.source}": [a.tau.value, a.tau.lo, a.tau.hi] for a in agree},
        "supported_reversals": {
            f"{a.region}|{a.source}": [[t.first, t.second] for t in a.supported] for a in agree
        },
    }
    md = _report(summary, at_load, by_region, agree, points)
    (out / "report.md").write_text("\n".join(md) + "\n")
    return summary


def _standing_table(st: Sequence[Standing]) -> list[str]:
    lines = ["| rank | policy | ANWG [95% CI] | tied | mean latency s [95% CI] | tied |"]
    lines.append("|---|---|---|---|---|---|")
    for k, s in enumerate(st, 1):
        ta = "best" if k == 1 else ("yes" if s.tied_anwg else "")
        tl = "yes" if s.tied_latency else ""
        lines.append(f"| {k} | {s.policy} | {s.anwg.fmt()} | {ta} | {s.latency_s.fmt(2)} | {tl} |")
    return lines


def _report(
    summary: dict[str, Any],
    at_load: Sequence[Standing],
    by_region: dict[str, list[Standing]],
    agree: Sequence[Agreement],
    regions: Sequence[str],
) -> list[str]:
    cap = summary["capture"]
    knees = summary["knees"]
    tied = summary["tied_with_recommended"]
    tied_l = summary["tied_with_best_latency"]
    md = [
        "# What-if on your traffic (simulation)",
        "",
        f"Capture `{summary['trace']}`: {cap['records']} records, "
        f"{cap['completed_requests']} completed, {cap['span_s']:.0f} s; "
        f"{len(knees)} windows of consecutive completed requests. Engine profile "
        f"`{summary['profile']}`; knees {min(knees):.3g}–{max(knees):.3g}. Public sources: the "
        f"first {summary['public_windows_per_source']} frozen windows of each, same profile.",
        "",
        "## Recommendation",
        "",
        f"Your recorded load is **{summary['measured_load_x_knee']:.3g}× the knee** (nearest "
        f"region {summary['nearest_region']}; utilisation "
        f"{summary['measured_utilisation']:.3g} of the engine's token capacity). "
        "Best by mean ANWG there: "
        f"**{summary['recommended']}**"
        + (f"; not significantly worse: {', '.join(tied)}" if tied else "")
        + f". Lowest mean latency: **{summary['best_mean_latency']}**"
        + (f"; not significantly slower: {', '.join(tied_l)}" if tied_l else "")
        + ". (Ties: the paired 95% bootstrap interval of the difference includes 0.)",
        "",
        "### At your measured load",
        "",
        *_standing_table(at_load),
        "",
        "## Agreement with the public sources (ANWG ranking, knee regions)",
        "",
        "| region | " + " | ".join(SOURCE_LABELS[s] + " τ-b [95% CI]" for s in SOURCES) + " |",
        "|---|" + "---|" * len(SOURCES),
    ]
    by = {(a.region, a.source): a for a in agree}
    for r in regions:
        cells = [by[(r, s)].tau.fmt(2) if (r, s) in by else "n/a" for s in SOURCES]
        md.append(f"| {r} | " + " | ".join(cells) + " |")
    flips = [a for a in agree if a.supported]
    md += ["", "Supported reversals (the study's test) between your traffic and a public source:"]
    md += [""] + (
        [
            f"- {a.region}, {SOURCE_LABELS[a.source]}: "
            + "; ".join(f"{t.first} vs {t.second}" for t in a.supported)
            for a in flips
        ]
        or ["- none"]
    )
    for r in regions:
        md += ["", f"## {r} ({REGIONS[r]}× knee)", "", *_standing_table(by_region[r])]
    md += [
        "",
        f"How to read it: the capture's windows are resampled ({summary['n_boot']:,} bootstrap "
        "draws) for every interval; with few windows the intervals are wide and ties are "
        "common. The simulated "
        "engine is the profile's, not your server: check a recommendation live with "
        "`sagesched compare` on a replay of the same capture.",
    ]
    return md
