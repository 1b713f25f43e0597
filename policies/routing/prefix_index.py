"""What a router sent where: per backend, an LRU set of the prompt blocks it was sent.

Blocks are chained hashes (`Job.prefix`): entry k stands for the whole prefix of blocks 0..k,
so a backend holds a prompt's first k blocks iff it holds entry k−1. The index is llm-d's
"approximate" prefix cache (REFERENCE.md §4): it never asks the engine, it remembers what it
routed and forgets the least recently used blocks beyond the backend's KV capacity.

An insertion touches the prompt's blocks last-first, so every block is at least as recent as
its descendants and the LRU evicts leaves before their ancestors (vLLM frees a request's
blocks in the same reverse order). The set therefore stays prefix-closed, and `match` finds
the longest cached prefix by bisection: O(log n) lookups for an n-block prompt. An insertion
is O(n) (each block's recency is refreshed). Pure: no clock, no I/O; not thread-safe.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

DEFAULT_KV_TOKENS = 500_000
"""KV capacity assumed for a backend that did not report one (tokens): llm-d's sizing note for
its default LRU (Llama-3-8B on an 80 GB H100 caches about 500K tokens, 31,250 blocks of 16)."""


class PrefixIndex:
    """One backend's LRU set of chained block hashes, at most `capacity_blocks` of them."""

    __slots__ = ("_lru", "capacity_blocks")

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be >= 0, not {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._lru: OrderedDict[int, None] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._lru

    def match(self, prefix: Sequence[int]) -> int:
        """How many leading blocks of `prefix` this backend holds (0..len(prefix)); no side
        effect on recency. Bisection over the prefix-closed set: O(log len(prefix))."""
        lru = self._lru
        n = len(prefix)
        if n == 0 or prefix[0] not in lru:
            return 0
        if prefix[n - 1] in lru:
            return n
        lo, hi = 1, n - 1  # blocks 0..lo-1 held, block hi not held
        while lo < hi:
            mid = (lo + hi) // 2
            if prefix[mid] in lru:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def insert(self, prefix: Sequence[int]) -> None:
        """Record that `prefix` was sent here: every block becomes most recent (the first block
        most recent of all), then the oldest blocks beyond the capacity are forgotten."""
        lru = self._lru
        touch = lru.move_to_end
        for h in reversed(prefix):
            if h in lru:
                touch(h)
            else:
                lru[h] = None
        self._trim()

    def remove(self, block_hashes: Iterable[int]) -> None:
        """Forget blocks the engine reported evicted (leaf first, as vLLM evicts)."""
        for h in block_hashes:
            self._lru.pop(h, None)

    def resize(self, capacity_blocks: int) -> None:
        """Change the capacity (the backend's KV changed); shrinking forgets the oldest."""
        if capacity_blocks != self.capacity_blocks:
            self.capacity_blocks = max(capacity_blocks, 0)
            self._trim()

    def _trim(self) -> None:
        lru = self._lru
        while len(lru) > self.capacity_blocks:
            lru.popitem(last=False)


def capacity_blocks(kv_tokens: int | None, block_tokens: int) -> int:
    """Index capacity in blocks of `block_tokens` for a backend holding `kv_tokens` of KV
    (`DEFAULT_KV_TOKENS` when unknown)."""
    tokens = DEFAULT_KV_TOKENS if kv_tokens is None else kv_tokens
    return tokens // max(block_tokens, 1)


class PrefixIndexes:
    """The per-run indexes of every backend a router has sent to, by backend name."""

    __slots__ = ("_by_name",)

    def __init__(self) -> None:
        self._by_name: dict[str, PrefixIndex] = {}

    def get(self, name: str) -> PrefixIndex | None:
        """The backend's index, or None if nothing was sent there yet."""
        return self._by_name.get(name)

    def match(self, name: str, prefix: Sequence[int]) -> int:
        """Leading blocks of `prefix` sent to backend `name` and not yet forgotten."""
        index = self._by_name.get(name)
        return 0 if index is None else index.match(prefix)

    def size(self, name: str) -> int:
        """Blocks held for backend `name` (SGLang's "tree size")."""
        index = self._by_name.get(name)
        return 0 if index is None else len(index)

    def insert(self, name: str, prefix: Sequence[int], capacity: int) -> None:
        """Record `prefix` as sent to `name`, whose index holds `capacity` blocks."""
        index = self._by_name.get(name)
        if index is None:
            index = self._by_name[name] = PrefixIndex(capacity)
        else:
            index.resize(capacity)
        index.insert(prefix)

    def remove(self, name: str, block_hashes: Iterable[int]) -> None:
        index = self._by_name.get(name)
        if index is not None:
            index.remove(block_hashes)
