"""The real-engine check of the portability study's disagreements (pure parts).

`bench/reversal_check.py` replays the windows behind a simulated ranking reversal on the real
vLLM CPU build; this module holds what it decides without a server, so it is tested alone:

- which reversal to check: `supported_reversals` (the study's own classification of tidy rows,
  strongest first) and `representative_window` (a window whose paired difference is its
  source's median);
- how an engine-level contender runs on vLLM: `VLLM_ARMS` (the flags, whether the client sends
  each request's prompt length as vLLM `priority`, what vLLM cannot reproduce) and the engine
  configuration the side-by-side simulation runs for it;
- the scaled-down case: `scaled_trace` (first N requests, capped lengths, the paper's SLO
  recomputed on them) and `cpu_load_factor` (the same multiple of the window's knee, the knee
  found on the real engine's latency profile);
- `flip_holds`: whether a measured order agrees with a simulated one.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from loadgen.engine.configs import EngineConfig, engine_config
from loadgen.engine.profiles import LatencyProfile
from loadgen.regions import REGIONS, find_knee, slo_deadline
from loadgen.schema import TraceRequest, Window

if TYPE_CHECKING:
    from loadgen.study.grid import Row


@dataclass(frozen=True, slots=True)
class Reversal:
    """A supported practical reversal of the study (values oriented: higher is better)."""

    metric: str
    region: str
    source_a: str
    source_b: str
    first: str
    second: str
    diff_a: float
    """mean(first) − mean(second) in source A."""
    diff_b: float
    strength: float
    """The smaller, over the two sources, of |difference| / |loser's mean|."""
    p: float


def supported_reversals(
    rows: Sequence[Row],
    *,
    axis: str = "knee",
    metric: str = "anwg",
    policies: Sequence[str] | None = None,
    n_boot: int | None = None,
) -> list[Reversal]:
    """The study's supported practical reversals in tidy `rows` (`loadgen.study.grid.Row`),
    classified exactly as the report does (`loadgen.study.analysis.reversals`), strongest
    first (ties: smaller p, then names)."""
    from loadgen.study import analysis, stats
    from loadgen.study.grid import HEADLINE_POLICIES

    grid = analysis.build(rows, tuple(policies or HEADLINE_POLICIES))
    found = analysis.reversals(grid, axis, [metric], n_boot=n_boot or stats.N_BOOT)
    col = {p: i for i, p in enumerate(grid.policies)}
    out = []
    for m, region, a, b, t in found.supported:
        rel = []
        for source in (a, b):
            means = stats.policy_means(grid.get(axis, source, region, m))
            x, y = means[col[t.first]], means[col[t.second]]
            rel.append(abs(x - y) / max(abs(min(x, y)), 1e-12))
        out.append(Reversal(m, region, a, b, t.first, t.second, t.diff_a.value, t.diff_b.value,
                            float(min(rel)), t.p))  # fmt: skip
    out.sort(key=lambda r: (-r.strength, r.p, r.region, r.source_a, r.source_b, r.first))
    return out


def window_diffs(
    rows: Sequence[Row], source: str, region: str, first: str, second: str,
    *, axis: str = "knee", metric: str = "anwg",
) -> dict[str, float]:  # fmt: skip
    """Per window of `source`: value(first) − value(second) (raw, not oriented)."""
    vals: dict[str, dict[str, float]] = {}
    for r in rows:
        if (r.source, r.axis, r.region, r.metric) == (source, axis, region, metric) and (
            r.policy in (first, second)
        ):
            vals.setdefault(r.window, {})[r.policy] = r.value
    return {
        w: v[first] - v[second]
        for w, v in vals.items()
        if len(v) == 2 and not (math.isnan(v[first]) or math.isnan(v[second]))
    }


def representative_window(diffs: Mapping[str, float]) -> str:
    """The window whose difference is nearest its source's median (ties: the first id)."""
    if not diffs:
        raise ValueError("no window has both policies")
    med = statistics.median(diffs.values())
    return min(sorted(diffs), key=lambda w: abs(diffs[w] - med))


@dataclass(frozen=True, slots=True)
class VllmArm:
    """How one study contender runs on the real vLLM server."""

    contender: str
    """The study's engine configuration (`loadgen.engine.configs`)."""
    paper: str
    """The paper's policy name (`loadgen.study.grid.POLICIES`)."""
    flags: tuple[str, ...]
    """vLLM server flags (beside the fixed model, length and dtype flags)."""
    priority_by_prompt: bool
    """Send each request's prompt length as its vLLM `priority` (with `--scheduling-policy
    priority`: shortest prompt first in vLLM's waiting queue)."""
    played: dict[str, object]
    """Changes to the contender's configuration that give what vLLM actually runs (the
    side-by-side simulation runs both)."""
    not_reproduced: str
    """What of the contender vLLM cannot do, and why ('' when nothing)."""

    def simulated(self, *, as_played: bool) -> EngineConfig:
        """The contender's configuration, or what vLLM plays of it."""
        cfg = engine_config(self.contender)
        return cfg.with_(**self.played) if as_played and self.played else cfg


VLLM_ARMS: dict[str, VllmArm] = {
    a.contender: a
    for a in (
        VllmArm(
            "vllm-fcfs", "vllm_faithful",
            ("--no-enable-chunked-prefill", "--max-num-batched-tokens", "4096",
             "--max-num-seqs", "64"),
            False,
            {"prefill_pauses_decodes": False, "decode_first": True},
            "the prompt iteration that pauses every decode (vLLM V0 without chunking): V1's "
            "scheduler always runs the running decodes beside a new prompt",
        ),
        VllmArm(
            "sarathi", "sarathi_faithful",
            ("--enable-chunked-prefill", "--max-num-batched-tokens", "512",
             "--max-num-seqs", "128"),
            False,
            {},
            "",
        ),
        VllmArm(
            "slai", "slai_faithful",
            ("--enable-chunked-prefill", "--max-num-batched-tokens", "512",
             "--max-num-seqs", "64", "--scheduling-policy", "priority"),
            True,
            {"decode_defer_tbt_s": None, "prefill_free": False},
            "decode deferral to each request's last schedulable time (vLLM has no per-request "
            "TBT target and never holds back a runnable decode), and free prefill (the paper's "
            "simulator; a real engine computes every prompt token)",
        ),
    )
}  # fmt: skip
"""The engine-level contenders the check runs, by contender name."""


def vllm_args(contender: str) -> tuple[str, ...]:
    """The server flags of `contender` (ValueError for one vLLM cannot play)."""
    if contender not in VLLM_ARMS:
        raise ValueError(f"{contender!r} has no vLLM mapping; known: {sorted(VLLM_ARMS)}")
    return VLLM_ARMS[contender].flags


def scaled_trace(window: Window, n: int, max_prompt: int, max_output: int) -> list[TraceRequest]:
    """The first `n` requests of `window` with prompts and outputs capped, prediction scaled
    with the output (same relative error) and the paper's SLO recomputed on the capped lengths
    (window clock; `loadgen.regions.compress` then moves load and slack together)."""
    out = []
    for r in window.requests[:n]:
        prompt, output = min(r.prompt_tokens, max_prompt), min(r.output_tokens, max_output)
        pred = float(r.predicted_output_tokens or r.output_tokens) * output / r.output_tokens
        out.append(dataclasses.replace(
            r, prompt_tokens=prompt, output_tokens=output,
            predicted_output_tokens=max(1, round(pred)),
            deadline_s=slo_deadline(r.arrival_s, prompt, max(1, round(pred))),
        ))  # fmt: skip
    return out


def cpu_load_factor(
    trace: Sequence[TraceRequest], region: str, profile: str | LatencyProfile
) -> float:
    """`region`'s multiple of the trace's knee on `profile`, with vLLM's defaults on that
    machine (the emulator's engine configuration, FCFS, nothing held) as the knee's
    reference, as the study's knee uses FCFS on the paper's engine."""
    from loadgen.emulator import EmulatorConfig
    from loadgen.sim.simulator import Contender
    from policies.registry import parse_policy

    ref = Contender("fcfs", parse_policy("fcfs"), EmulatorConfig().engine_config(), None)
    return REGIONS[region] * find_knee(trace, profile=profile, contender=ref)


def flip_holds(
    simulated: Mapping[str, float], measured: Mapping[str, float], first: str, second: str,
    *, atol: float = 1e-9,
) -> bool | None:  # fmt: skip
    """Whether `first` − `second` has the same sign measured as simulated (None: one of the
    two is a tie within `atol`, so there is no order to hold)."""
    d_sim = simulated[first] - simulated[second]
    d_real = measured[first] - measured[second]
    if abs(d_sim) <= atol or abs(d_real) <= atol:
        return None
    return (d_sim > 0) == (d_real > 0)
