"""The per-backend LRU index of prompt blocks: leading matches, leaf-first eviction."""

from __future__ import annotations

import random

import pytest

from policies.routing import PrefixIndex, PrefixIndexes
from policies.routing.prefix_index import DEFAULT_KV_TOKENS, capacity_blocks


def chain(root: int, n: int) -> tuple[int, ...]:
    """n chained block hashes under `root` (distinct per (root, depth))."""
    return tuple(root * 1000 + k for k in range(n))


def test_match_counts_leading_blocks() -> None:
    index = PrefixIndex(100)
    index.insert(chain(1, 10))
    assert index.match(chain(1, 10)) == 10
    assert index.match(chain(1, 25)) == 10  # a longer prompt shares the first 10
    assert index.match(chain(1, 4)) == 4
    assert index.match(chain(2, 10)) == 0
    assert index.match(()) == 0
    assert len(index) == 10


def test_lru_forgets_the_least_recent_and_leaves_before_ancestors() -> None:
    index = PrefixIndex(12)
    index.insert(chain(1, 8))
    index.insert(chain(1, 4))  # the first 4 blocks sent again: only blocks 4..7 are older
    index.insert(chain(2, 8))  # 16 blocks > 12: the least recent four go, chain 1's leaves
    assert index.match(chain(1, 8)) == 4
    assert index.match(chain(2, 8)) == 8
    assert len(index) == 12
    index.insert(chain(3, 4))  # then the oldest insertion still held, all of it
    assert index.match(chain(1, 8)) == 0 and len(index) == 12


def test_match_leaves_recency_alone_and_insert_refreshes_it() -> None:
    index = PrefixIndex(10)
    index.insert(chain(1, 5))
    index.insert(chain(2, 5))
    index.match(chain(1, 5))  # a lookup is not a use
    index.insert(chain(3, 5))
    assert index.match(chain(1, 5)) == 0 and index.match(chain(2, 5)) == 5
    index.insert(chain(2, 5))  # sent again: most recent
    index.insert(chain(4, 5))
    assert index.match(chain(2, 5)) == 5 and index.match(chain(3, 5)) == 0


def test_resize_remove_and_zero_capacity() -> None:
    index = PrefixIndex(20)
    index.insert(chain(1, 10))
    index.insert(chain(1, 6))
    index.resize(6)
    assert index.match(chain(1, 10)) == 6
    index.remove([chain(1, 10)[5]])
    assert index.match(chain(1, 10)) == 5
    empty = PrefixIndex(0)
    empty.insert(chain(1, 3))
    assert len(empty) == 0 and empty.match(chain(1, 3)) == 0
    with pytest.raises(ValueError):
        PrefixIndex(-1)


def test_bisection_agrees_with_a_linear_scan() -> None:
    """Random sessions that share and extend prefixes, a tight capacity: the bisection over the
    prefix-closed set gives what scanning block by block gives."""
    rng = random.Random(0)
    index = PrefixIndex(150)
    sessions: list[tuple[int, ...]] = [chain(r, rng.randrange(1, 30)) for r in range(1, 20)]
    for _ in range(2000):
        i = rng.randrange(len(sessions))
        base = sessions[i]
        prompt = base[: rng.randrange(1, len(base) + 1)] + chain(rng.randrange(100, 10**6), 3)
        linear = 0
        while linear < len(prompt) and prompt[linear] in index:
            linear += 1
        assert index.match(prompt) == linear
        index.insert(prompt)
        if rng.random() < 0.3:
            sessions[i] = prompt


def test_indexes_by_backend_and_capacity_from_kv() -> None:
    indexes = PrefixIndexes()
    indexes.insert("a", chain(1, 6), capacity=4)
    assert indexes.match("a", chain(1, 6)) == 4 and indexes.size("a") == 4
    assert indexes.match("b", chain(1, 6)) == 0 and indexes.size("b") == 0
    indexes.insert("a", chain(2, 2), capacity=2)  # the backend's KV shrank
    assert indexes.size("a") == 2
    assert capacity_blocks(8192, 512) == 16
    assert capacity_blocks(None, 16) == DEFAULT_KV_TOKENS // 16


def test_reinsertion_under_capacity_keeps_the_record_bounded() -> None:
    """A hot prompt sent again and again keeps one record, not one per sending; forgotten
    blocks do not pile up in memory either."""
    index = PrefixIndex(1000)
    for _ in range(5000):
        index.insert(chain(1, 10))
    assert len(index) == 10
    assert index.stored <= 2 * 10 and len(index._count) == 1
    index.insert(chain(2, 995))  # over capacity: chain 1 is the least recent
    assert index.match(chain(1, 10)) == 0 and index.match(chain(2, 995)) == 995
    for root in range(3, 40):  # forgotten entries are deleted as insertions go on
        index.insert(chain(root, 100))
    assert len(index) <= 1000 and index.stored <= 3 * 1000
