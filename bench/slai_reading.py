"""Why `slai` ranked last in the portability study, and what the corrected reading changes.

    python bench/slai_reading.py                      # 5 windows per source, all six regions
    python bench/slai_reading.py --windows 8 --regions KNEE,HIGH_PRESSURE
    python bench/slai_reading.py --rows results/lssp/tidy.csv.gz   # + ranks, reversals

Two tables on the first N frozen LSSP windows per source (`lssp-constant`, the study's knee
load points, mean ANWG over the windows):

1. **Mechanisms.** SLAI with one rule changed at a time, from our first reading (`before`:
   128 sequences, prompts run through the 512-token budget at 512 tokens per 1-ms iteration)
   and from the corrected one (`slai`: the paper's engine — 64 sequences, prefill free, the
   prompt's chunks still spending the budget). `no-defer` turns decode deferral off,
   `fcfs-order` admits by arrival instead of shortest prompt first.
2. **Ranks and reversals** (with `--rows`, a study's tidy table made with the old `slai`):
   `slai`'s rank among the headline policies (1 = best mean ANWG over all windows) per source
   and region before and after (every `slai` cell simulated again), and the supported ANWG
   reversals of both grids (the study's own classification).

See docs/simulator.md ("SLAI: our reading against the paper's code") for the finding.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loadgen.engine.configs import EngineConfig, engine_config  # noqa: E402
from loadgen.metrics import summarize  # noqa: E402
from loadgen.regions import REGIONS, compress  # noqa: E402
from loadgen.replay.reversal_check import supported_reversals  # noqa: E402
from loadgen.sim.simulator import Contender, simulate  # noqa: E402
from loadgen.study.grid import (  # noqa: E402
    HEADLINE_POLICIES,
    SOURCE_LABELS,
    SOURCES,
    Row,
    cell_metrics,
    contender,
    load_point,
    read_rows,
    windows_of,
)
from policies.registry import parse_policy  # noqa: E402

SLAI = engine_config("slai")
BEFORE = SLAI.with_(name="slai-before", prefill_free=False, max_seqs=128)
"""Our first reading (commit before this bench): SLAI's own 128 sequences, prompts paid in
iterations of the 512-token budget."""


def variants() -> dict[str, EngineConfig]:
    """The SLAI variants of the mechanism table, by column name."""
    return {
        "before": BEFORE,
        "before no-defer": BEFORE.with_(decode_defer_tbt_s=None),
        "before @64": BEFORE.with_(max_seqs=64),
        "before free-prefill": BEFORE.with_(prefill_free=True),
        "slai": SLAI,
        "slai no-defer": SLAI.with_(decode_defer_tbt_s=None),
        "slai fcfs-order": SLAI.with_(waiting_order="arrival"),
    }


def _on(cfg: EngineConfig) -> Contender:
    return Contender(cfg.name, parse_policy(cfg.gateway), cfg, cfg.inflight_cap)


def anwg(source: str, index: int, region: str, who: Contender) -> float:
    """ANWG of one cell (a window at a knee load point)."""
    window = windows_of(source)[index]
    factor, slo = load_point(window, "knee", region)
    res = simulate(compress(window.requests, factor, slo_factor=slo), who)
    return float(summarize(res.records)["anwg"])


def rank_of(name: str, means: dict[str, float]) -> int:
    """1-based rank of `name` by mean (higher is better; ties share the better rank)."""
    return 1 + sum(1 for v in means.values() if v > means[name])


def mechanisms(windows: int, regions: list[str]) -> None:
    """Table 1: mean ANWG of each SLAI variant (and vllm_faithful, fifo) per source, region."""
    cols = variants()
    refs = {p: contender(p) for p in ("vllm_faithful", "fifo")}
    print(f"Mean ANWG, first {windows} windows per source (lssp-constant, knee load points)\n")
    print("| source | region | " + " | ".join([*cols, *refs]) + " |")
    print("|---" * (len(cols) + len(refs) + 2) + "|")
    for source in SOURCES:
        n = min(windows, len(windows_of(source)))
        for region in regions:
            runs = {k: _on(c) for k, c in cols.items()} | refs
            means = [statistics.mean(anwg(source, i, region, c) for i in range(n))
                     for c in runs.values()]  # fmt: skip
            cells = [SOURCE_LABELS[source], region, *(f"{v:.3f}" for v in means)]
            print("| " + " | ".join(cells) + " |", flush=True)


def with_new_slai(rows: list[Row]) -> list[Row]:
    """`rows` with every knee-axis `slai_faithful` cell simulated again (current `slai`)."""
    out = [r for r in rows if not (r.axis == "knee" and r.policy == "slai_faithful")]
    cells = sorted({(r.source, r.window, r.region) for r in rows
                    if r.axis == "knee" and r.policy == "slai_faithful"})  # fmt: skip
    by_id = {(s, w.window_id): w for s in SOURCES for w in windows_of(s)}
    for source, wid, region in cells:
        for metric, value in cell_metrics(by_id[(source, wid)], "knee", region,
                                          "slai_faithful").items():  # fmt: skip
            out.append(Row(source, wid, "knee", region, "slai_faithful", metric, value))
    return out


def ranks_and_reversals(path: Path, n_boot: int) -> None:
    """Table 2 and the supported reversals that involve slai, before and after, all windows."""
    before = [r for r in read_rows(path) if r.axis == "knee"]
    after = with_new_slai(before)
    means: dict[str, dict[tuple[str, str], dict[str, float]]] = {}
    for label, rows in (("before", before), ("after", after)):
        acc: dict[tuple[str, str], dict[str, list[float]]] = {}
        for r in rows:
            if r.metric == "anwg" and r.policy in HEADLINE_POLICIES and r.value == r.value:
                acc.setdefault((r.source, r.region), {}).setdefault(r.policy, []).append(r.value)
        means[label] = {k: {p: statistics.mean(v) for p, v in d.items()} for k, d in acc.items()}
    print(f"\nslai's rank among {len(HEADLINE_POLICIES)} headline policies (mean ANWG over all "
          "windows, 1 = best), and slai − vllm_faithful\n")  # fmt: skip
    print("| source | region | rank before | rank after | slai before | slai after | vllm |")
    print("|---|---|---|---|---|---|---|")
    for source in SOURCES:
        for region in REGIONS:
            b, a = means["before"][(source, region)], means["after"][(source, region)]
            print(f"| {SOURCE_LABELS[source]} | {region} | {rank_of('slai_faithful', b)} | "
                  f"{rank_of('slai_faithful', a)} | {b['slai_faithful']:.3f} | "
                  f"{a['slai_faithful']:.3f} | {a['vllm_faithful']:.3f} |")  # fmt: skip
    for label, rows in (("before", before), ("after", after)):
        found = supported_reversals([r for r in rows if r.metric == "anwg"], n_boot=n_boot)
        slai = [r for r in found if "slai_faithful" in (r.first, r.second)]
        print(f"\nsupported ANWG reversals {label}: {len(found)}; with slai: {len(slai)}")
        for r in found:
            print(
                f"- {r.first} vs {r.second} ({SOURCE_LABELS[r.source_a]}–"
                f"{SOURCE_LABELS[r.source_b]}, {r.region}): {r.diff_a:+.3f} / {r.diff_b:+.3f}"
            )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--windows", type=int, default=5, help="first N windows per source (table 1)")
    ap.add_argument("--regions", default=",".join(REGIONS))
    ap.add_argument("--rows", type=Path, help="a study's tidy.csv.gz (table 2: all windows)")
    ap.add_argument("--boot", type=int, default=2000)
    args = ap.parse_args(argv)
    started = time.perf_counter()
    mechanisms(args.windows, args.regions.split(","))
    if args.rows:
        ranks_and_reversals(args.rows, args.boot)
    print(f"\n{time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
