"""SageSched against its baselines in simulation (`sagesched study --mode sagesched`).

Workloads, per dataset and utilisation level, one per *replicate* (seed or trace window):
- ShareGPT and Alpaca (no timestamps): `n_requests` prompts drawn from a held-out test split,
  Poisson arrivals; lengths in MiniLM word pieces (`predictor.datasets`), prompts capped at
  `MAX_PROMPT_TOKENS` and outputs at `MAX_OUTPUT_TOKENS`;
- the Azure 2023 conversation trace: windows of `n_requests` consecutive requests with their
  real arrival times (stride sampler), no prompt text.
- document writing (`predictor.datasets.document_pairs`): whole ShareGPT conversations as one
  request each (answers of ~1,500 tokens), `memory_requests` per replicate, Poisson arrivals.
Arrivals are compressed so offered decode work is `util` × the engine's token capacity
(`loadgen.regions.factor_for_utilisation`). Two regimes (`Regime`), each a profile, an engine
configuration and a gateway cap, with a drain long enough that every request finishes (mean
TTLT over all requests, no survivor bias):
- `compute` (ShareGPT, Alpaca, Azure): `h200-llama3-8b` on the `continuous` engine behind the
  gateway cap of 64; the batch is bounded by sequences, KV never binds;
- `memory` (document writing): `h200-qwen3-32b` on the `h200-qwen3-32b` engine (vLLM V1's H200
  defaults, 245,760 paged KV tokens, recompute preemption) behind a gateway cap at the batch
  the KV cache holds for the workload (`kv_cap`): the KV cache bounds the batch.

Prediction arms: `semantic` = the real `predictor.LengthPredictor` trained on a disjoint
train split, its own distributions handed to every prediction-driven policy (ShareGPT and
Alpaca only: Azure has no text); `oracle-<e>` = the true length × exp(N(0, e²)) (seeded), with
a log-normal belief of σ = e around it (a point mass at e = 0). FCFS, FastServe (prompt length
only) and the SRPT oracle do not read predictions and run once per workload.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from loadgen.engine.configs import EngineConfig, engine_config
from loadgen.metrics import summarize
from loadgen.regions import compress, factor_for_utilisation, kv_batch
from loadgen.schema import TraceRequest
from loadgen.sim.simulator import Contender, resolve, simulate
from policies.dist import LengthDist

PROFILE = "h200-llama3-8b"
SAGESCHED = "sagesched"
BASELINES = ("fcfs", "ssjf", "trail", "fastserve", "ltr", "srpt-oracle")
PREEMPTION_VARIANTS = ("sagesched:preemptive=false", "sagesched:preempt_rule=index")
"""SageSched never preempting, and preempting whenever the index says so (the old default)."""
COST_VARIANTS = ("sagesched:cost=tokens", "sagesched:cost=time")
"""SageSched's index over other cost models (the default is `kv`)."""
VARIANTS = (*PREEMPTION_VARIANTS, *COST_VARIANTS)
CONTENDERS = (SAGESCHED, *BASELINES, *VARIANTS)
METRICS = ("ttlt_s_mean", "ttlt_s_p99", "ttft_s_mean", "ttft_s_p99", "completion_fraction")
MAX_PROMPT_TOKENS = 4096
MAX_OUTPUT_TOKENS = 4096
DRAIN_S = 36_000.0
CACHE_DIR = Path(__file__).resolve().parents[2] / ".cache" / "study"
TEXT_DATASETS = ("sharegpt", "alpaca", "docwriting")
TRACE_DATASET = "azure-conv-2023"
MEMORY_DATASETS = ("docwriting",)
KV_CAP_FRACTION = 0.9


@dataclass(frozen=True, slots=True)
class Regime:
    """Where a dataset runs: a latency profile, an engine configuration and a gateway cap."""

    name: str
    profile: str
    engine: str
    cap: int | None
    """Gateway in-flight cap; None: `kv_cap` of the workload."""


COMPUTE = Regime("compute", PROFILE, "continuous", 64)
MEMORY = Regime("memory", "h200-qwen3-32b", "h200-qwen3-32b", None)


def regime_of(dataset: str) -> Regime:
    return MEMORY if dataset in MEMORY_DATASETS else COMPUTE


def kv_cap(requests: Sequence[TraceRequest], engine: EngineConfig) -> int:
    """The gateway cap of the memory regime: `KV_CAP_FRACTION` of the sequences the KV cache
    holds for the workload (`loadgen.regions.kv_batch`), so the gateway
    keeps the backlog and the engine rarely preempts; what a cap tuned on vLLM's KV usage
    settles near (a fixed fraction, not tuned per policy)."""
    return max(1, min(engine.max_seqs, int(KV_CAP_FRACTION * kv_batch(requests, engine))))


@dataclass(frozen=True, slots=True)
class EvalConfig:
    """Sizes of the evaluation (`small` is the seconds-long CI grid)."""

    datasets: tuple[str, ...] = ("sharegpt", "alpaca", TRACE_DATASET, "docwriting")
    utils: tuple[float, ...] = (0.8, 0.95, 1.2)
    errors: tuple[float, ...] = (0.0, 0.2, 0.5)
    replicates: int = 6
    """Seeds (text datasets) or trace windows (Azure) per (dataset, util)."""
    n_requests: int = 500
    n_train: int = 3000
    n_test: int = 1000
    semantic: bool = True
    seed: int = 0
    memory_utils: tuple[float, ...] = (0.8, 1.0, 1.2, 1.5)
    """Utilisation levels of the memory regime."""
    memory_requests: int = 2000
    """Requests per memory-regime workload: answers take ~50 s, so a window needs thousands
    of arrivals to reach a steady queue rather than a transient."""
    memory_test: int = 3000
    memory_replicates: int = 3
    """Seeds per (util) of the memory regime (each workload is 4× the compute regime's)."""


SMALL = EvalConfig(
    datasets=("sharegpt", TRACE_DATASET, "docwriting"),
    utils=(1.5,),
    errors=(0.0, 0.5),
    replicates=3,
    n_requests=150,
    n_train=150,
    n_test=150,
    memory_utils=(1.5,),
    memory_requests=150,
    memory_test=150,
    memory_replicates=2,
)


class Result(NamedTuple):
    dataset: str
    util: float
    replicate: int
    arm: str
    policy: str
    metric: str
    value: float


Semantic = tuple[tuple[LengthDist, ...], tuple[float, ...]]
"""The real predictor's beliefs and ranking scores for a workload's requests, in order."""


@dataclass(frozen=True, slots=True)
class Task:
    """One workload: every arm x contender on it."""

    dataset: str
    util: float
    replicate: int
    requests: tuple[TraceRequest, ...]
    arms: tuple[tuple[str, tuple[LengthDist, ...] | None, float], ...]
    """(arm name, per-request beliefs or None, belief σ for the noisy oracle)."""
    regime: Regime = COMPUTE
    rank_scores: tuple[float, ...] | None = None
    """The real predictor's ranking score per request (the `semantic` arm's `ltr`)."""


# -- workloads ------------------------------------------------------------------------------


def text_split(dataset: str, n_train: int, n_test: int, seed: int) -> tuple[list[Any], list[Any]]:
    """Disjoint (train, test) records of a prompt dataset, cached as JSONL."""
    from predictor.datasets import build_split
    from predictor.model import read_jsonl

    stem = f"{dataset}_{n_train}_{n_test}_{seed}"
    train, test = CACHE_DIR / f"{stem}_train.jsonl", CACHE_DIR / f"{stem}_test.jsonl"
    if not (train.exists() and test.exists()):
        build_split(dataset, n_train, n_test, train, test, seed=seed)
    return list(read_jsonl(train)), list(read_jsonl(test))


def semantic_beliefs(
    dataset: str, train: Sequence[Any], test: Sequence[Any], seed: int
) -> tuple[list[LengthDist], list[float]]:
    """The real predictor's distribution and its ranking model's score (`Job.rank_score`, for
    `ltr`) for every test record (cached as .npz, keyed by the split and the predictor's
    configuration)."""
    import hashlib

    from predictor.config import PredictorConfig

    tag = hashlib.sha256(repr(PredictorConfig()).encode()).hexdigest()[:8]
    path = CACHE_DIR / f"{dataset}_{len(train)}_{len(test)}_{seed}_{tag}_semantic_rank.npz"
    if path.exists():
        data = np.load(path)
        return [
            LengthDist(data["support"][a:b], data["probs"][a:b])
            for a, b in zip(data["start"][:-1], data["start"][1:], strict=True)
        ], [float(v) for v in data["rank"]]
    import torch

    from predictor.evaluate import SemanticPredictor
    from predictor.model import LengthPredictor

    # one intra-op thread: the study's worker processes share the cores, and oversubscribed
    # OpenMP threads spin (measured here: ~270 ms per prompt instead of ~3 ms)
    torch.set_num_threads(1)

    model = SemanticPredictor(LengthPredictor())
    model.fit(train)
    dists = model.predict(test)
    start = np.cumsum([0] + [d.support.size for d in dists])
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(
        path,
        support=np.concatenate([d.support for d in dists]),
        probs=np.concatenate([d.probs for d in dists]),
        start=start,
        rank=np.asarray(model.rank_scores, dtype=float),
    )
    return dists, list(model.rank_scores)


def _poisson(
    records: Sequence[Any], n: int, rng: np.random.Generator
) -> tuple[list[int], list[TraceRequest]]:
    """`n` test records (indices, requests) in random order with unit-rate Poisson arrivals."""
    idx = rng.choice(len(records), size=min(n, len(records)), replace=False)
    t = np.cumsum(rng.exponential(1.0, size=idx.size))
    t -= t[0]
    reqs = [
        TraceRequest(
            arrival_s=float(at),
            prompt_tokens=max(1, min(int(records[i]["prompt_tokens"]), MAX_PROMPT_TOKENS)),
            output_tokens=max(1, min(int(records[i]["output_tokens"]), MAX_OUTPUT_TOKENS)),
            source=str(records[i].get("source", "")),
        )
        for i, at in zip(idx, t, strict=True)
    ]
    return [int(i) for i in idx], reqs


def _at_util(requests: Sequence[TraceRequest], util: float, regime: Regime) -> list[TraceRequest]:
    engine = engine_config(regime.engine)
    factor = factor_for_utilisation(requests, util, engine=engine, profile=regime.profile)
    return compress(requests, factor)


def _noisy(
    requests: Sequence[TraceRequest], error: float, rng: np.random.Generator
) -> list[TraceRequest]:
    noise = np.exp(rng.normal(0.0, error, size=len(requests))) if error > 0 else None
    return [
        dataclasses.replace(
            r,
            predicted_output_tokens=max(
                1, round(r.output_tokens * (noise[k] if noise is not None else 1.0))
            ),
        )
        for k, r in enumerate(requests)
    ]


def tasks(cfg: EvalConfig) -> list[Task]:
    """Every workload of the evaluation, with its prediction arms."""
    out: list[Task] = []
    for dataset in cfg.datasets:
        if dataset == TRACE_DATASET:
            from loadgen.traces import load_windows

            windows = load_windows(
                dataset, n_requests=cfg.n_requests, count=cfg.replicates, seed=cfg.seed
            )
            bases: list[tuple[int, Semantic | None, list[TraceRequest]]] = [
                (k, None, list(w.requests)) for k, w in enumerate(windows)
            ]
        else:
            memory = dataset in MEMORY_DATASETS
            n_test = cfg.memory_test if memory else cfg.n_test
            n = cfg.memory_requests if memory else cfg.n_requests
            train, test = text_split(dataset, cfg.n_train, n_test, cfg.seed)
            predicted = semantic_beliefs(dataset, train, test, cfg.seed) if cfg.semantic else None
            bases = []
            for k in range(cfg.memory_replicates if memory else cfg.replicates):
                idx, reqs = _poisson(test, n, np.random.default_rng([cfg.seed, k]))
                sem = None
                if predicted is not None:
                    beliefs, ranks = predicted
                    sem = (tuple(beliefs[i] for i in idx), tuple(ranks[i] for i in idx))
                bases.append((k, sem, reqs))
        utils = cfg.memory_utils if dataset in MEMORY_DATASETS else cfg.utils
        for util in utils:
            for k, sem, reqs in bases:
                out.append(_task(dataset, util, k, reqs, sem, cfg))
    return out


def _task(
    dataset: str,
    util: float,
    k: int,
    reqs: Sequence[TraceRequest],
    sem: Semantic | None,
    cfg: EvalConfig,
) -> Task:
    arms: list[tuple[str, tuple[LengthDist, ...] | None, float]] = []
    if sem is not None:
        arms.append(("semantic", sem[0], 0.0))
    arms += [(f"oracle-{round(100 * e)}%", None, e) for e in cfg.errors]
    regime = regime_of(dataset)
    reqs = _at_util(reqs, util, regime)
    ranks = None if sem is None else sem[1]
    return Task(dataset, util, k, tuple(reqs), tuple(arms), regime, ranks)


# -- running --------------------------------------------------------------------------------


def contender(
    name: str, regime: Regime = COMPUTE, requests: Sequence[TraceRequest] = ()
) -> Contender:
    """`name` on the regime's engine behind its gateway cap, drained until all finish."""
    engine = dataclasses.replace(engine_config(regime.engine), drain_s=DRAIN_S)
    cap = regime.cap if regime.cap is not None else kv_cap(requests, engine)
    c = resolve(name, inflight_cap=cap)
    return dataclasses.replace(c, engine=engine)


def run_task(task: Task) -> list[Result]:
    """Every contender on one workload; policies that read no prediction run once (arm "-")."""
    rows: list[Result] = []
    profile = task.regime.profile
    for name in CONTENDERS:
        c = contender(name, task.regime, task.requests)
        if not c.policy.needs_prediction:
            rows += _rows(task, "-", c.name, simulate(task.requests, c, profile).records)
            continue
        for k, (arm, beliefs, sigma) in enumerate(task.arms):
            reqs: Sequence[TraceRequest] = task.requests
            if beliefs is None:
                rng = np.random.default_rng([task.replicate, k, round(task.util * 100), 7])
                reqs = _noisy(task.requests, sigma, rng)
            # the semantic arm's `ltr` ranks by the predictor's ranking model, as it would live
            ranks = task.rank_scores if arm == "semantic" else None
            res = simulate(reqs, c, profile, belief_sigma=sigma, beliefs=beliefs, rank_scores=ranks)
            rows += _rows(task, arm, c.name, res.records)
    return rows


def _rows(task: Task, arm: str, policy: str, records: Sequence[Any]) -> list[Result]:
    s = summarize(records)
    return [Result(task.dataset, task.util, task.replicate, arm, policy, m, s[m]) for m in METRICS]


def run_all(cfg: EvalConfig, *, workers: int | None = None, progress: bool = True) -> list[Result]:
    """All tasks in parallel (2 processes by default); rows sorted."""
    from tqdm import tqdm  # type: ignore[import-untyped]

    todo = tasks(cfg)
    rows: list[Result] = []
    with (
        ProcessPoolExecutor(max_workers=workers or 2) as pool,
        tqdm(total=len(todo), unit="workload", disable=not progress) as bar,
    ):
        for fut in as_completed([pool.submit(run_task, t) for t in todo]):
            rows += fut.result()
            bar.update(1)
    rows.sort(key=lambda r: r[:6])
    return rows


def read_results(path: Path) -> list[Result]:
    """Read what `sagesched study sagesched` wrote to `sagesched.csv`."""
    import csv

    with path.open(newline="") as f:
        reader = csv.reader(f)
        next(reader)
        return [Result(r[0], float(r[1]), int(r[2]), r[3], r[4], r[5], float(r[6])) for r in reader]
