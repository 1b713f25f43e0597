"""What a router sent where: per backend, an LRU set of the prompt blocks it was sent.

Blocks are chained hashes (`Job.prefix`): entry k stands for the whole prefix of blocks 0..k,
so a backend holds a prompt's first k blocks iff it holds entry k−1. The index is llm-d's
"approximate" prefix cache (REFERENCE.md §4): it never asks the engine, it remembers what it
routed and forgets the least recently used blocks beyond the backend's KV capacity.

An insertion touches the prompt's blocks last-first, so every block is at least as recent as
its descendants and the LRU evicts leaves before their ancestors (vLLM frees a request's
blocks in the same reverse order). The set therefore stays prefix-closed, and `match` finds
the longest cached prefix by bisection: O(log n) lookups for an n-block prompt. An insertion
refreshes every block's recency in C (`dict.update`) and evicts in O(1) per insertion;
forgotten entries go a generation at a time.
Pure: no clock, no I/O; not thread-safe.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from itertools import repeat

DEFAULT_KV_TOKENS = 500_000
"""KV capacity assumed for a backend that did not report one (tokens): llm-d's sizing note for
its default LRU (Llama-3-8B on an 80 GB H100 caches about 500K tokens, 31,250 blocks of 16)."""


class PrefixIndex:
    """One backend's LRU set of chained block hashes, at most `capacity_blocks` of them.

    Recency is kept per insertion: each block maps to the insertion (tick) that last touched
    it, `_count` counts the blocks each live tick still stamps (oldest first), and blocks
    stamped at or below `_floor` are forgotten. Forgetting the least recent insertion is
    raising the floor past it, O(1). Stamps live in two generations: new ones go to `_cur`;
    once the floor has passed every stamp in `_prev`, `_prev` is dropped whole and `_cur`
    takes its place, so forgotten entries cost no per-block work and memory stays within
    about two capacity windows of blocks. An insertion is a few C-level calls however long
    the prompt; eviction takes the least recently touched blocks one insertion at a time (the
    index may hold up to one prompt's blocks below its capacity after an eviction).
    """

    __slots__ = (
        "_count",
        "_cur",
        "_floor",
        "_live",
        "_prev",
        "_switch",
        "_tick",
        "capacity_blocks",
    )

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be >= 0, not {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._cur: dict[int, int] = {}  # block -> tick that last touched it (ticks >= _switch)
        self._prev: dict[int, int] = {}  # the previous generation (ticks < _switch)
        self._count: OrderedDict[int, int] = OrderedDict()  # live tick -> blocks, oldest first
        self._switch = 1  # first tick written to `_cur`
        self._floor = 0  # blocks stamped at or below it are forgotten
        self._live = 0  # blocks stamped above the floor
        self._tick = 0

    def __len__(self) -> int:
        return self._live

    def __contains__(self, block_hash: object) -> bool:
        return self._stamp(block_hash) > self._floor  # type: ignore[arg-type]

    @property
    def stored(self) -> int:
        """Entries kept in memory, live or forgotten (at most about twice the live ones)."""
        return len(self._cur) + len(self._prev)

    def _stamp(self, block_hash: int) -> int:
        stamp = self._cur.get(block_hash)
        return self._prev.get(block_hash, 0) if stamp is None else stamp

    def match(self, prefix: Sequence[int]) -> int:
        """How many leading blocks of `prefix` this backend holds (0..len(prefix)); no side
        effect on recency. Bisection over the prefix-closed set: O(log len(prefix))."""
        n = len(prefix)
        if n == 0:
            return 0
        cur, prev, floor = self._cur.get, self._prev.get, self._floor  # `_stamp`, inlined
        if (cur(prefix[0]) or prev(prefix[0], 0)) <= floor:
            return 0
        if (cur(prefix[n - 1]) or prev(prefix[n - 1], 0)) > floor:
            return n
        lo, hi = 1, n - 1  # blocks 0..lo-1 held, block hi not held
        while lo < hi:
            mid = (lo + hi) // 2
            if (cur(prefix[mid]) or prev(prefix[mid], 0)) > floor:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def insert(self, prefix: Sequence[int], held: int | None = None) -> None:
        """Record that `prefix` was sent here: all its blocks become the most recent, then the
        least recent insertions beyond the capacity are forgotten. `held`: `match(prefix)`,
        if the caller has it. The hashes of `prefix` are distinct (a chain)."""
        if len(prefix) > self.capacity_blocks:  # what fits is its first blocks
            prefix = prefix[: self.capacity_blocks]
            held = None
        if not prefix:
            return
        end = self.match(prefix) if held is None else held  # 0..end-1 live, the rest new
        self._live += len(prefix) - end
        while end > 0:  # stamps fall along a chain: release the runs of equal ticks
            old = self._stamp(prefix[end - 1])
            start = self._first_stamped(prefix, old, end - 1)
            self._release(old, end - start)
            end = start
        self._tick += 1
        self._cur.update(zip(prefix, repeat(self._tick)))  # in C
        self._count[self._tick] = len(prefix)
        self._evict()

    def remove(self, block_hashes: Iterable[int]) -> None:
        """Forget blocks the engine reported evicted. Leaf first, as vLLM evicts: a block
        removed before its descendants breaks the prefix closure `match` relies on."""
        for h in block_hashes:
            stamp = self._stamp(h)
            self._cur.pop(h, None)
            self._prev.pop(h, None)
            if stamp > self._floor:
                self._live -= 1
                self._release(stamp, 1)

    def resize(self, capacity_blocks: int) -> None:
        """Change the capacity (the backend's KV changed); shrinking forgets the oldest."""
        if capacity_blocks != self.capacity_blocks:
            self.capacity_blocks = max(capacity_blocks, 0)
            self._evict()

    def _first_stamped(self, prefix: Sequence[int], tick: int, last: int) -> int:
        """The first i ≤ `last` from which every block of `prefix` up to `last` is stamped
        `tick` (`prefix[last]` is; stamps never rise along a chain). Bisection."""
        lo, hi = 0, last
        while lo < hi:
            mid = (lo + hi) // 2
            if self._stamp(prefix[mid]) == tick:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def _release(self, tick: int, n: int) -> None:
        """`n` blocks stamped `tick` were touched again (or removed)."""
        left = self._count[tick] - n
        if left:
            self._count[tick] = left
        else:  # nothing of that insertion is left to forget
            del self._count[tick]

    def _evict(self) -> None:
        """Forget the least recent insertions until the live blocks fit the capacity; drop
        the older generation once all of it is forgotten."""
        while self._live > self.capacity_blocks:
            tick, n = self._count.popitem(last=False)
            self._live -= n
            self._floor = tick
        if self._floor >= self._switch - 1 and self._cur:
            self._prev, self._cur = self._cur, {}
            self._switch = self._tick + 1


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

    def insert(
        self, name: str, prefix: Sequence[int], capacity: int, held: int | None = None
    ) -> None:
        """Record `prefix` as sent to `name`, whose index holds `capacity` blocks (`held`:
        its match there, if known)."""
        index = self._by_name.get(name)
        if index is None:
            index = self._by_name[name] = PrefixIndex(capacity)
            held = 0
        elif index.capacity_blocks != capacity:
            index.resize(capacity)
            held = None
        index.insert(prefix, held)

    def remove(self, name: str, block_hashes: Iterable[int]) -> None:
        index = self._by_name.get(name)
        if index is not None:
            index.remove(block_hashes)
