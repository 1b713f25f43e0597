"""Engine configurations: typed, frozen batching rules registered under stable names.

The names are the engine-level contenders of the portability study (REFERENCE.md §2): each
pairs batching rules inside the engine with the queue-level policy the gateway runs in front of
it (`gateway`, a `policies` spec) and how much the gateway lets through (`inflight_cap`). The
names must not collide with `policies` names, so a contender name on the CLI is unambiguous.
`continuous` is the plain engine that queue-level policies run on.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

WaitingOrder = Literal["arrival", "prompt", "priority"]
KVModel = Literal["paged", "admission"]

_ENGINES: dict[str, EngineConfig] = {}


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Batching rules of one engine (sizes in tokens, times in seconds of virtual time)."""

    name: str
    """Stable name (CLI, reports)."""
    description: str
    """One line for listings."""
    max_seqs: int = 64
    """Most sequences in one iteration (vLLM `max_num_seqs`)."""
    max_batch_tokens: int = 4096
    """Token budget per iteration (vLLM `max_num_batched_tokens`)."""
    budget_counts_decodes: bool = False
    """Whether each decode spends one token of the budget (vLLM V1) or only prompt tokens do."""
    budget_counts_prompts: bool = True
    """Whether prompt tokens spend the budget. The portability paper's engine prefills for free
    and counts only the one token per active sequence against its 4,096-token budget."""
    kv_tokens: int = 131_072
    """KV-cache capacity; allocated in blocks of `block_tokens`."""
    block_tokens: int = 16
    """KV block size."""
    kv_model: KVModel = "paged"
    """`paged`: KV in blocks, every token needs room, recompute preemption when it runs out
    (vLLM). `admission`: the portability paper's model, where a request is admitted only if the
    KV in use plus its prompt fits, and decode growth is never checked (no preemption)."""
    skip_blocked: bool = False
    """A waiting request that does not fit (KV, budget) is passed over and later ones may be
    admitted (the paper's fifo); otherwise the head blocks the queue (vLLM)."""
    chunk_tokens: int | None = None
    """Chunked prefill: most prompt tokens of one sequence per iteration (None: whole prompts)."""
    decode_first: bool = True
    """Running sequences take the budget before new prompts are admitted."""
    prefill_free: bool = False
    """The portability paper's simulator (prefill instantaneous, REFERENCE.md §2): a prompt
    still spends the token budget in chunks of `chunk_tokens` over its first iterations (its
    scheduler's bookkeeping, which throttles admissions and, with `decode_defer_tbt_s`, leaves
    less budget for deferred decodes), but it is computed at admission: the first token comes at
    the end of the admission iteration and the sequence decodes every iteration, outside the
    budget and never deferred, while its remaining chunks are booked."""
    prefill_pauses_decodes: bool = False
    """vLLM V0 without chunking: an iteration that admits a prompt runs no decodes."""
    preemption: bool = True
    """Recompute preemption when a decode needs a KV block and none is free. When False,
    admission reserves KV for prompt + predicted output and a short decode waits instead."""
    priority_scheduling: bool = False
    """Preempt the running sequence with the largest (priority, arrival) rather than the last
    one admitted (vLLM `--scheduling-policy priority`)."""
    waiting_order: WaitingOrder = "arrival"
    """Engine waiting queue order: arrival (vLLM FCFS), shortest prompt first (SLAI), or
    (priority, arrival) with lower priority values first (vLLM `--scheduling-policy priority`)."""
    kv_admit_fraction: float | None = None
    """Admit only while KV use is at most this fraction, unless the request is urgent."""
    urgent_laxity_s: float = 0.25
    """A request with laxity at most this is urgent (bypasses `kv_admit_fraction`)."""
    min_laxity_s: float | None = None
    """Drop a request whose laxity at admission is below this (None: never drop)."""
    kv_throttle_fraction: float | None = None
    """Stop admitting while KV use is above this fraction (admission throttling)."""
    laxity_token_s: float = 0.001
    """Service-time estimate per token for laxity: deadline − now − (w·prompt + predicted
    output)·this, with w = `laxity_prompt_weight`."""
    laxity_prompt_weight: float = 0.5
    """Weight of prompt tokens in the laxity estimate (0.5 in the paper's LLF and KV gate)."""
    watermark_fraction: float = 0.01
    """Paged KV: admission leaves at least this share of blocks free (vLLM's watermark)."""
    decode_defer_tbt_s: float | None = None
    """SLAI decode deferral: a decode runs only once `now + offset` reaches its last token time
    plus this time-between-tokens target (None: every decode runs every iteration)."""
    defer_offset_iters: int = 5
    """SLAI offset Θ in iterations (the iteration time is the last one observed)."""
    defer_offset_iters_high: int = 10
    """Θ while KV use is at or above `defer_memory_fraction`."""
    defer_memory_fraction: float = 0.96
    """KV fraction at which SLAI switches to the larger offset."""
    gateway: str = "fcfs"
    """Queue-level policy (a `policies` spec) the gateway runs in front of this engine."""
    inflight_cap: int | None = None
    """Most requests the gateway lets into the engine at once (None: all, as vLLM admits)."""
    drain_s: float = 50.0
    """After the last arrival the run continues this long; what is left is dropped."""
    prefix_caching: bool = True
    """Automatic prefix caching (vLLM V1's default; paged KV only): requests carrying prompt
    block hashes skip the prefill of their longest cached prefix (docs/simulator.md)."""

    @property
    def kv_blocks(self) -> int:
        """KV capacity in blocks."""
        return self.kv_tokens // self.block_tokens

    def with_(self, **changes: object) -> EngineConfig:
        """A copy with some fields changed (validated)."""
        return replace(self, **changes)  # type: ignore[arg-type]

    def __post_init__(self) -> None:
        if self.max_seqs < 1 or self.max_batch_tokens < 1 or self.block_tokens < 1:
            raise ValueError(f"engine {self.name}: sizes must be positive")
        if self.kv_tokens < self.block_tokens:
            raise ValueError(f"engine {self.name}: KV smaller than one block")
        if self.chunk_tokens is not None and self.chunk_tokens < 1:
            raise ValueError(f"engine {self.name}: chunk_tokens must be positive")


def register_engine(config: EngineConfig) -> EngineConfig:
    """Add `config` under its name; a second registration of a name is an error."""
    if config.name in _ENGINES:
        raise ValueError(f"engine configuration {config.name!r} registered twice")
    _ENGINES[config.name] = config
    return config


def engine_names() -> list[str]:
    """All registered engine configuration names, sorted."""
    return sorted(_ENGINES)


def engine_config(name: str) -> EngineConfig:
    """The configuration registered under `name`."""
    try:
        return _ENGINES[name]
    except KeyError:
        raise ValueError(
            f"unknown engine configuration {name!r}; known: {engine_names()}"
        ) from None


CONTINUOUS = register_engine(
    EngineConfig(
        "continuous",
        "the portability paper's engine, under queue-level policies: 64 sequences, free prefill, "
        "4,096 decode tokens per iteration, 131,072 KV tokens checked at admission, no preemption",
        budget_counts_decodes=True,
        budget_counts_prompts=False,
        kv_model="admission",
        skip_blocked=True,
    )
)
register_engine(
    EngineConfig(
        "vllm-fcfs",
        "vLLM FCFS without chunking: a prompt iteration pauses decodes, 16-token KV blocks, "
        "recompute preemption from the back",
        budget_counts_decodes=True,
        prefill_pauses_decodes=True,
        decode_first=False,
    )
)
register_engine(
    EngineConfig(
        "vllm-chunked-prefill",
        "vLLM FCFS with chunked prefill: decodes first, prompt chunks fill the 4,096-token budget",
        budget_counts_decodes=True,
        chunk_tokens=4096,
    )
)
register_engine(
    EngineConfig(
        "sarathi",
        "Sarathi-Serve: decode-first, 512-token budget with prompt chunks, 128 sequences",
        budget_counts_decodes=True,
        max_batch_tokens=512,
        chunk_tokens=512,
        max_seqs=128,
    )
)
register_engine(
    EngineConfig(
        "slai",
        "SLAI as the portability paper ran it: shortest-prompt-first admission, decodes deferred "
        "to their last schedulable time (TBT 0.5 s, offset 5/10 iterations), a 512-token budget "
        "that prompts spend in chunks while prefill itself is free, 64 sequences (the paper "
        "engine's cap under SLAI's own 128)",
        budget_counts_decodes=True,
        max_batch_tokens=512,
        chunk_tokens=512,
        max_seqs=64,
        prefill_free=True,
        waiting_order="prompt",
        decode_defer_tbt_s=0.5,
    )
)
register_engine(
    EngineConfig(
        "kv-constrained",
        "admit while KV use ≤ 82% unless the request's laxity ≤ 0.25 s",
        kv_admit_fraction=0.82,
        kv_model="admission",
        skip_blocked=True,
        budget_counts_decodes=True,
        budget_counts_prompts=False,
    )
)
register_engine(
    EngineConfig(
        "admission-control",
        "laxity filter at admission (default threshold filters nothing)",
        min_laxity_s=float("-inf"),
        kv_model="admission",
        skip_blocked=True,
        budget_counts_decodes=True,
        budget_counts_prompts=False,
    )
)
register_engine(
    EngineConfig(
        "token-budget",
        "shortest predicted output first at the gateway (capped at 64 in flight), no preemption",
        gateway="ssjf",
        inflight_cap=64,
        kv_model="admission",
        skip_blocked=True,
        budget_counts_decodes=True,
        budget_counts_prompts=False,
    )
)
register_engine(
    EngineConfig(
        "slo-guard",
        "deadline guard: earliest deadline first at the gateway, hopeless requests (deadline "
        "before now + predicted output × 1 ms) dropped, admissions throttled above 90% KV use",
        gateway="edf",
        inflight_cap=64,
        min_laxity_s=0.0,
        laxity_prompt_weight=0.0,
        kv_throttle_fraction=0.9,
        kv_model="admission",
        skip_blocked=True,
        budget_counts_decodes=True,
        budget_counts_prompts=False,
    )
)

QWEN3_32B_H200_KV_TOKENS = 245_760
"""KV capacity of Qwen3-32B (bf16) on one H200 at vLLM's default `gpu_memory_utilization` 0.9:
0.9 × 140.4 GiB − 61.0 GiB of weights (32.8B parameters) − ~4.4 GiB of activations and graphs
≈ 61 GiB, at 64 layers × 2 (K, V) × 8 KV heads × 128 dims × 2 bytes = 256 KiB per token, is
about 250,000 tokens; rounded down to 15,360 blocks of 16."""

H200_QWEN3_32B = register_engine(
    EngineConfig(
        "h200-qwen3-32b",
        "vLLM V1 on one H200 serving Qwen3-32B: its API-server defaults there (1,024 sequences, "
        "8,192-token budget, chunked prefill), 245,760 KV tokens paged, recompute preemption",
        max_seqs=1024,
        max_batch_tokens=8192,
        chunk_tokens=8192,
        budget_counts_decodes=True,
        kv_tokens=QWEN3_32B_H200_KV_TOKENS,
    )
)
"""The memory-bound regime of the SageSched evaluation: with answers of ~1,500 tokens KV fills
long before 1,024 sequences (defaults from vLLM 0.32 `EngineArgs._set_default_max_num_seqs_and_
batched_tokens_args` for GPUs with ≥ 70 GiB)."""

LLAMA31_8B_H200_KV_TOKENS = 870_400
"""KV capacity of Llama-3.1-8B (bf16) on one H200 at vLLM's default `gpu_memory_utilization`
0.9, derived as Qwen3-32B's: 0.9 × 140.4 GiB − 15.0 GiB of weights (8.03B parameters) − ~5 GiB
of activations, graphs and non-torch memory (the Qwen3-32B derivation's 4.4 GiB, rounded up for
the 8,192-token profiling batch) ≈ 106.4 GiB, at 32 layers × 2 (K, V) × 8 KV heads × 128 dims
× 2 bytes = 128 KiB per token, is about 871,300 tokens; rounded down to 54,400 blocks of 16.
Not the 131,072 of the LSSP engine (`continuous`), which models a smaller memory."""

H200_LLAMA3_8B = register_engine(
    EngineConfig(
        "h200-llama3-8b",
        "vLLM V1 on one H200 serving Llama-3.1-8B: its API-server defaults there (1,024 "
        "sequences, 8,192-token budget, chunked prefill), 870,400 KV tokens paged, recompute "
        "preemption, prefix caching",
        max_seqs=1024,
        max_batch_tokens=8192,
        chunk_tokens=8192,
        budget_counts_decodes=True,
        kv_tokens=LLAMA31_8B_H200_KV_TOKENS,
    )
)
"""The routing study's backend (docs/routing.md): the compute-bound model with the KV it
really holds, so a prefix cache keeps what a real replica would."""
