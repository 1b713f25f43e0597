"""The engine model: iteration-level continuous batching with paged KV and recompute preemption.

One `Engine.step(now, horizon_s)` plans an iteration (which sequences decode, which prompt
chunks run, who is admitted, preempted or dropped), asks the latency profile how long it takes
and applies it. When nothing can change before the next external event (no prompt in flight,
every running sequence decodes, admission is blocked by something only a completion can lift)
the step covers several identical decode iterations at once, so a long decode costs one Python
step, not one per token. Conventions (see docs/simulator.md):

- a sequence whose (last) prompt chunk runs in iteration t emits its first output token at the
  end of t; one more token per decode iteration after that, so output O finishes at the end of
  iteration t+O−1;
- KV holds the computed prompt plus the generated tokens, in blocks of `block_tokens`;
- preempted sequences lose their KV and recompute prompt + generated tokens as a prefill
  (vLLM's recompute mode), from the front of the waiting queue;
- prefix caching (`EngineConfig.prefix_caching`, paged KV only; `prefix_cache.py`): a
  sequence carrying prompt block hashes is admitted with its longest cached prefix already
  computed, and its computed prompt blocks stay cached (LRU-evicted when KV is needed).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from loadgen.engine.configs import EngineConfig
from loadgen.engine.prefix_cache import PrefixCache
from loadgen.engine.profiles import LatencyProfile
from policies.job import Job

Blocked = Literal["empty", "seqs", "kv", "gate", "budget"]


@dataclass(slots=True, eq=False)
class Seq:
    """One request inside the engine (sizes in tokens, times in virtual seconds)."""

    job: Job
    output: int
    """True output length: the sequence finishes when `generated` reaches it."""
    predicted: float
    """Predicted output length (laxity estimates and KV reservations)."""
    generated: int = 0
    kv: int = 0
    """Tokens held in KV (computed prompt + generated)."""
    blocks: int = 0
    prefill_left: int = 0
    """Prompt (or recompute) tokens still to run before the next token."""
    booked_left: int = 0
    """`prefill_free` engines: prompt tokens computed at admission but not yet charged to a
    token budget (booked in chunks over the next iterations while the sequence decodes)."""
    last_token_s: float = 0.0
    first_token_s: float | None = None
    preemptions: int = 0
    """Engine-level (KV) preemptions."""
    priority: int | None = None
    """vLLM `priority` the request carries (lower first); None: the job's priority class."""
    hashes: tuple[int, ...] = ()
    """Chained block hashes of the prompt (`TraceRequest.block_hashes`; empty: never hits),
    possibly going on over the output when the workload knows its tokens (session turns)."""
    hash_tokens: int = 0
    """Tokens per entry of `hashes` (a multiple of the engine's `block_tokens`)."""
    cached: int = 0
    """Leading entries of `hashes` this sequence holds in the engine's prefix cache."""
    recompute: bool = False
    """Waiting again after an engine preemption (its lookup is not counted, as in vLLM)."""

    @property
    def prompt(self) -> int:
        return self.job.prompt_tokens

    @property
    def order(self) -> tuple[int, float, int]:
        """(priority, arrival, id): vLLM's priority-scheduling order (lower first)."""
        job = self.job
        return (job.priority if self.priority is None else self.priority, job.arrival_s, job.id)


@dataclass(slots=True)
class StepResult:
    """What one `Engine.step` did. `dt_s` covers `iterations` iterations."""

    dt_s: float
    iterations: int
    finished: list[Seq] = field(default_factory=list)
    dropped: list[Seq] = field(default_factory=list)


@dataclass(slots=True)
class _Batch:
    decodes: list[Seq] = field(default_factory=list)
    prefills: list[tuple[Seq, int]] = field(default_factory=list)
    booked: list[tuple[Seq, int]] = field(default_factory=list)
    """`prefill_free`: (sequence, prompt tokens charged to the budget this iteration)."""
    budget: int = 0
    admitted: int = 0
    preempted: int = 0
    dropped: list[Seq] = field(default_factory=list)


class Engine:
    """One engine replica. Not thread-safe; owned by one simulation."""

    def __init__(self, config: EngineConfig, profile: LatencyProfile) -> None:
        self.cfg = config
        self.profile = profile
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.capacity = config.kv_blocks if config.kv_model == "paged" else config.kv_tokens
        """KV capacity in the model's units (blocks when paged, tokens otherwise)."""
        self.free_blocks = self.capacity
        self._blocked: Blocked = "empty"
        paged = config.kv_model == "paged"
        self._watermark = int(config.watermark_fraction * self.capacity) if paged else 0
        self.iterations = 0
        self.preemptions = 0
        self.generated_tokens = 0
        """Output tokens generated so far (vLLM's `generation_tokens_total`)."""
        self.prompt_tokens = 0
        """Prompt (and recompute) tokens prefilled so far (vLLM's `prompt_tokens_total`)."""
        self.token_gap_s = 0.0
        self.token_gaps = 0
        """Seconds between consecutive output tokens of each request, summed, and how many
        (vLLM's `inter_token_latency_seconds` sum and count)."""
        self.cache = PrefixCache(config.block_tokens) if config.prefix_caching and paged else None
        """The prefix cache (None: off, or the admission KV model)."""
        self._last_iter_s = profile.iteration_s(1, 0, 0)

    # -- membership -----------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running)

    @property
    def prefix_cache_queries(self) -> int:
        """Prompt tokens new requests looked up in the prefix cache (vLLM's counter)."""
        return 0 if self.cache is None else self.cache.queries

    @property
    def prefix_cache_hits(self) -> int:
        """Of `prefix_cache_queries`, tokens found cached (vLLM's counter)."""
        return 0 if self.cache is None else self.cache.hits

    def add(self, seq: Seq) -> None:
        """A request reaches the engine (new, or resumed after a gateway preemption)."""
        seq.kv = seq.blocks = seq.booked_left = seq.cached = 0
        seq.recompute = False
        seq.prefill_left = seq.prompt + seq.generated
        if self.cache is not None:
            self.cache.entry_blocks(seq)  # a hash block size the engine cannot use fails here
        self.waiting.append(seq)

    def abort(self, seq: Seq) -> None:
        """Take `seq` out wherever it is (client gone, gateway preemption); frees its KV."""
        if seq in self.running:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self._free(seq)

    def kv_fraction(self) -> float:
        """Share of KV blocks in use."""
        return 1.0 - self.free_blocks / self.capacity

    def laxity_s(self, seq: Seq, now: float) -> float:
        """deadline − now − estimated service (inf without a deadline)."""
        if seq.job.deadline_s is None:
            return math.inf
        cfg = self.cfg
        left = max(seq.predicted - seq.generated, 0.0)
        est = (cfg.laxity_prompt_weight * seq.prompt + left) * cfg.laxity_token_s
        return seq.job.deadline_s - now - est

    # -- one step ---------------------------------------------------------------------------

    def step(self, now: float, horizon_s: float) -> StepResult:
        """Run one iteration starting at `now` (or several, but never past `horizon_s` from
        now: the time of the next external event). The engine must not be empty."""
        batch = self._plan(now)
        if not batch.decodes and not batch.prefills:
            # nothing runnable (every decode stalled without preemption): lose one iteration
            dt = self._last_iter_s
            self.iterations += 1
            return StepResult(dt, 1, [], batch.dropped)
        k = self._jump(batch, now, horizon_s)
        n = len(batch.decodes)
        ctx = sum(s.kv for s in batch.decodes)
        if k > 1:
            dt = self.profile.decode_run_s(n, ctx, k)
        else:
            work = batch.booked if self.cfg.prefill_free else batch.prefills
            dt = self.profile.iteration_s(n, ctx, sum(c for _, c in work))
        self._last_iter_s = dt / k
        self.iterations += k
        # each decoding request waited the iteration for its token (vLLM's inter-token latency)
        self.token_gap_s += n * dt
        self.token_gaps += n * k
        finished = self._apply(batch, k, now + dt)
        return StepResult(dt, k, finished, batch.dropped)

    def _plan(self, now: float) -> _Batch:
        cfg = self.cfg
        b = _Batch(budget=cfg.max_batch_tokens)
        deferred: list[Seq] = []
        if cfg.decode_first:
            deferred = self._schedule_running(b, now)
            # vLLM: an iteration that had to preempt admits nothing (no thrashing)
            self._blocked = "kv" if b.preempted else self._admit(b, now)
            self._serve_deferred(b, deferred)
        else:
            self._blocked = self._admit(b, now)
            if not (cfg.prefill_pauses_decodes and b.admitted):
                self._serve_deferred(b, self._schedule_running(b, now))
        return b

    def _schedule_running(self, b: _Batch, now: float) -> list[Seq]:
        """Schedule running sequences in order; returns the decodes deferred (SLAI)."""
        cfg = self.cfg
        deferred: list[Seq] = []
        booking: list[Seq] = []
        tbt = cfg.decode_defer_tbt_s
        offset_s = self._offset_iters() * self._last_iter_s if tbt is not None else 0.0
        for seq in list(self.running):
            if seq not in self.running:
                continue  # preempted as a victim earlier in this loop
            if seq.booked_left > 0:  # prefill_free: decodes outside the budget, never deferred
                booking.append(seq)
                if self._grow(seq, 1, b):
                    b.decodes.append(seq)
            elif seq.prefill_left > 0:
                chunk = min(seq.prefill_left, cfg.chunk_tokens or seq.prefill_left, b.budget)
                if chunk > 0 and self._grow(seq, chunk + (chunk == seq.prefill_left), b):
                    b.prefills.append((seq, chunk))
                    b.budget -= chunk
            elif tbt is not None and now < seq.last_token_s + tbt - offset_s:
                deferred.append(seq)
            elif (not cfg.budget_counts_decodes or b.budget >= 1) and self._grow(seq, 1, b):
                b.decodes.append(seq)
                b.budget -= cfg.budget_counts_decodes
        for seq in booking:  # after the decodes, as SLAI's continuing chunks
            chunk = min(seq.booked_left, cfg.chunk_tokens or seq.booked_left, b.budget)
            if chunk > 0 and seq in self.running:
                b.booked.append((seq, chunk))
                b.budget -= chunk
        return deferred

    def _serve_deferred(self, b: _Batch, deferred: list[Seq]) -> None:
        """Non-critical decodes use what budget is left, closest to their deadline first."""
        deferred.sort(key=lambda s: (s.last_token_s, s.job.id))
        for seq in deferred:
            if self.cfg.budget_counts_decodes and b.budget < 1:
                break
            if seq in self.running and self._grow(seq, 1, b):
                b.decodes.append(seq)
                b.budget -= self.cfg.budget_counts_decodes

    def _offset_iters(self) -> int:
        cfg = self.cfg
        high = self.kv_fraction() >= cfg.defer_memory_fraction
        return cfg.defer_offset_iters_high if high else cfg.defer_offset_iters

    # -- admission --------------------------------------------------------------------------

    def _candidates(self) -> list[Seq]:
        """Waiting sequences in engine order (preempted ones first in arrival mode)."""
        if self.cfg.waiting_order == "prompt":
            return sorted(self.waiting, key=lambda s: (s.prefill_left, s.job.arrival_s, s.job.id))
        if self.cfg.waiting_order == "priority":
            return sorted(self.waiting, key=lambda s: s.order)
        return list(self.waiting)

    def _admit(self, b: _Batch, now: float) -> Blocked:
        """Admit waiting sequences in engine order; says what stopped it (for jumping).

        Without `skip_blocked` the first request that does not fit blocks the rest; with it,
        it is passed over. "budget" (or a drop) means the next iteration may differ."""
        cfg = self.cfg
        blocked: Blocked = "empty"
        for seq in self._candidates() if self.waiting else ():
            if len(self.running) >= cfg.max_seqs:
                return "seqs" if blocked == "empty" else blocked
            laxity = self.laxity_s(seq, now)
            if cfg.min_laxity_s is not None and laxity < cfg.min_laxity_s:
                self.waiting.remove(seq)
                b.dropped.append(seq)
                continue
            reason = self._try_admit(seq, b, laxity)
            if reason is None:
                continue
            if blocked != "budget":
                blocked = reason
            if not cfg.skip_blocked:
                return blocked
        return blocked

    def _try_admit(self, seq: Seq, b: _Batch, laxity: float) -> Blocked | None:
        """Admit `seq` into this batch, or say why not."""
        cfg = self.cfg
        if self._gated(laxity):
            return "gate"
        hit, hit_free = self._hit(seq)
        chunk = min(seq.prefill_left, cfg.chunk_tokens or seq.prefill_left)
        if not cfg.budget_counts_prompts:
            pass
        elif cfg.chunk_tokens is not None:
            chunk = min(chunk, b.budget)
        elif chunk > b.budget and (b.prefills or b.budget < cfg.max_batch_tokens):
            chunk = 0  # a whole prompt over the budget runs only in an otherwise empty batch
        if chunk <= 0:
            self._unhit(seq, hit)
            return "budget"
        run = seq.prefill_left if cfg.prefill_free else chunk  # computed now
        need = self._admit_need(seq, run)
        if need + hit_free > self._kv_free() - self._watermark:
            self._unhit(seq, hit)
            return "kv"
        self.waiting.remove(seq)
        if self.cache is not None:
            self.cache.acquire(seq, hit)
            self.cache.count(seq, seq.kv)
            self.free_blocks -= hit_free
        self._take(seq, need)
        self.running.append(seq)
        b.prefills.append((seq, run))
        if cfg.prefill_free:
            seq.booked_left = seq.prefill_left
            b.booked.append((seq, chunk))
        b.budget -= chunk if cfg.budget_counts_prompts else 0
        b.admitted += 1
        return None

    def _hit(self, seq: Seq) -> tuple[int, int]:
        """Look `seq` up in the prefix cache and mark its cached prefix computed (tentatively:
        `_unhit` undoes it). Returns (entries hit, engine blocks of those that are free)."""
        if self.cache is None or not seq.hashes:
            return 0, 0
        hit, hit_free = self.cache.match(seq)
        tokens = hit * seq.hash_tokens
        seq.kv, seq.blocks = tokens, tokens // self.cfg.block_tokens
        seq.prefill_left -= tokens
        return hit, hit_free

    def _unhit(self, seq: Seq, hit: int) -> None:
        if hit:
            seq.prefill_left += seq.kv
            seq.kv = seq.blocks = 0

    def _admit_need(self, seq: Seq, chunk: int) -> int:
        """KV units (blocks, or tokens in the admission model) to admit `seq` with `chunk`."""
        cfg = self.cfg
        if cfg.kv_model == "admission":
            return seq.prefill_left  # the whole prompt (+ recomputed output) is charged now
        need = self._blocks_for(seq.kv + chunk + (chunk == seq.prefill_left)) - seq.blocks
        if not cfg.preemption:
            reserve = seq.prompt + max(math.ceil(seq.predicted), seq.generated + 1)
            need = max(need, self._blocks_for(reserve) - seq.blocks)
        return need

    def _gated(self, laxity: float) -> bool:
        cfg = self.cfg
        frac = self.kv_fraction()
        if cfg.kv_throttle_fraction is not None and frac > cfg.kv_throttle_fraction:
            return True
        return (
            cfg.kv_admit_fraction is not None
            and frac > cfg.kv_admit_fraction
            and laxity > cfg.urgent_laxity_s
        )

    # -- KV -----------------------------------------------------------------------------------
    # Paged model: `seq.blocks` blocks per sequence, `kv_free` counts free blocks. Admission
    # model: `seq.blocks` holds the tokens charged at admission plus decode growth, and
    # `kv_free` counts free tokens (it may go negative: decode growth is not checked).

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.cfg.block_tokens)

    def _kv_free(self) -> int:
        return self.free_blocks

    def _take(self, seq: Seq, units: int) -> None:
        if self.cache is not None and units > 0:
            self.cache.take(units, self.free_blocks)
        self.free_blocks -= units
        seq.blocks += units

    def _free(self, seq: Seq) -> None:
        if self.cache is None:
            self.free_blocks += seq.blocks
        else:
            if seq.hashes:  # blocks its decodes filled, where its chain covers them
                self.free_blocks += self.cache.register(seq)
            self.free_blocks += self.cache.release(seq)
        seq.blocks = seq.kv = 0

    def _grow(self, seq: Seq, tokens: int, b: _Batch) -> bool:
        """Give `seq` KV for `tokens` more; preempt (or stall) when short. False: not scheduled."""
        if self.cfg.kv_model == "admission":
            return True  # charged at admission; decode growth is booked in `_apply`
        need = self._blocks_for(seq.kv + tokens) - seq.blocks
        while need > self.free_blocks:
            if not self.cfg.preemption:
                return False
            victim = self._victim()
            self._preempt(victim, b)
            if victim is seq:
                return False
        if need > 0:
            self._take(seq, need)
        return True

    def _victim(self) -> Seq:
        if self.cfg.priority_scheduling:
            return max(self.running, key=lambda s: s.order)
        return self.running[-1]

    def _preempt(self, seq: Seq, b: _Batch) -> None:
        self.running.remove(seq)
        if seq in b.decodes:
            b.decodes.remove(seq)
        for i, (s, chunk) in enumerate(b.prefills):
            if s is seq:
                del b.prefills[i]
                b.budget += 0 if self.cfg.prefill_free else chunk
                break
        for i, (s, chunk) in enumerate(b.booked):
            if s is seq:
                del b.booked[i]
                b.budget += chunk
                break
        self._free(seq)
        seq.booked_left = 0
        seq.prefill_left = seq.prompt + seq.generated
        seq.preemptions += 1
        seq.recompute = True
        self.preemptions += 1
        b.preempted += 1
        self.waiting.appendleft(seq)

    # -- jumping and applying -----------------------------------------------------------------

    def _jump(self, b: _Batch, now: float, horizon_s: float) -> int:
        """How many identical pure-decode iterations this batch may run (≥ 1)."""
        if (
            b.prefills
            or b.booked
            or (self.cfg.prefill_free and any(s.booked_left for s in self.running))
            or b.preempted
            or b.dropped
            or len(b.decodes) != len(self.running)
            or self._blocked not in ("empty", "seqs", "kv", "gate")
        ):
            return 1
        k = min(s.output - s.generated for s in b.decodes)
        if k <= 1:
            return 1
        if self._blocked == "gate" and self.cfg.kv_admit_fraction is not None:
            horizon_s = min(horizon_s, self._urgent_in_s(now))
        n, ctx = len(b.decodes), sum(s.kv for s in b.decodes)
        k = min(k, self.profile.steps_within(n, ctx, horizon_s))
        if self.cfg.kv_model == "admission":
            return k
        return max(1, self._kv_steps(b.decodes, k))

    def _urgent_in_s(self, now: float) -> float:
        """Seconds until some waiting sequence's laxity falls to the urgency threshold."""
        lax = min((self.laxity_s(s, now) for s in self.waiting), default=math.inf)
        return max(lax - self.cfg.urgent_laxity_s, 0.0)

    def _kv_steps(self, seqs: list[Seq], k: int) -> int:
        """Largest j ≤ k whose KV growth fits in the free blocks (the first is allocated)."""

        def extra(j: int) -> int:
            return sum(max(0, self._blocks_for(s.kv + j) - s.blocks) for s in seqs)

        if extra(k) <= self.free_blocks:
            return k
        lo, hi = 1, k - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if extra(mid) <= self.free_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _apply(self, b: _Batch, k: int, end_s: float) -> list[Seq]:
        finished: list[Seq] = []
        if self.cfg.kv_model == "admission":
            for seq in b.decodes:
                self._take(seq, k)
            for seq, chunk in b.prefills:
                self._take(seq, chunk == seq.prefill_left)  # the first output token
        elif k > 1:
            for seq in b.decodes:
                self._take(seq, max(0, self._blocks_for(seq.kv + k) - seq.blocks))
        for seq, chunk in b.booked:
            seq.booked_left -= chunk
        self.generated_tokens += k * len(b.decodes)
        for seq in b.decodes:
            seq.generated += k
            seq.kv += k
            seq.last_token_s = end_s
            if seq.generated >= seq.output:
                finished.append(seq)
        cache = self.cache
        for seq, chunk in b.prefills:
            self.prompt_tokens += chunk
            seq.prefill_left -= chunk
            seq.kv += chunk
            if cache is not None and seq.hashes:
                self.free_blocks += cache.register(seq)
            if seq.prefill_left == 0:
                self.generated_tokens += 1
                seq.generated += 1
                seq.kv += 1
                seq.last_token_s = end_s
                if seq.first_token_s is None:
                    seq.first_token_s = end_s
                if seq.generated >= seq.output:
                    finished.append(seq)
        if finished:
            done = set(map(id, finished))
            self.running = [s for s in self.running if id(s) not in done]
            for seq in finished:
                self._free(seq)
        return finished
