from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from predictor import HistoryIndex, SnapshotError
from predictor.history import read_header

DIM = 16


def _unit(rng: np.random.Generator, n: int) -> np.ndarray:
    x = rng.standard_normal((n, DIM)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_query_finds_the_item_itself_with_its_lengths() -> None:
    rng = np.random.default_rng(0)
    x = _unit(rng, 50)
    idx = HistoryIndex(DIM, 100)
    idx.add(x, np.arange(50) + 1, np.arange(50) + 100)
    nb = idx.query(x[7], k=5)
    assert len(nb) == 5
    assert nb.similarity[0] == pytest.approx(1.0, abs=1e-5)
    assert nb.output_tokens[0] == 8 and nb.prompt_tokens[0] == 107
    assert np.all(np.diff(nb.similarity) <= 1e-6)  # best first


def test_empty_index_and_k_above_count() -> None:
    idx = HistoryIndex(DIM, 10)
    assert len(idx.query(np.ones(DIM), k=5)) == 0
    idx.add(_unit(np.random.default_rng(1), 2), [3, 4], [1, 1])
    assert len(idx.query(np.ones(DIM), k=5)) == 2


def test_similarity_floor_filters() -> None:
    idx = HistoryIndex(DIM, 10)
    e = np.eye(DIM, dtype=np.float32)
    idx.add(e[:3], [1, 2, 3], [1, 1, 1])
    nb = idx.query(e[0], k=3, similarity_floor=0.5)
    assert list(nb.output_tokens) == [1]


def test_ring_replaces_oldest_first() -> None:
    e = np.eye(DIM, dtype=np.float32)
    idx = HistoryIndex(DIM, 4)
    idx.add(e[:3], [10, 11, 12], [1, 1, 1])
    idx.add(e[3:6], [13, 14, 15], [1, 1, 1])  # 10 and 11 are replaced by 14 and 15
    assert len(idx) == 4 and idx.added == 6
    assert sorted(idx.query(e[0], k=4).output_tokens) == [12, 13, 14, 15]
    assert idx.query(e[5], k=1).output_tokens[0] == 15
    assert list(idx.recent(10)[0]) == [15, 14, 13, 12]
    idx.add(e[:9], np.arange(9) + 20, np.ones(9))  # more than capacity at once: newest win
    assert list(idx.recent(4)[0]) == [28, 27, 26, 25]


def test_concurrent_adds_and_queries_are_safe() -> None:
    idx = HistoryIndex(DIM, 500)
    errors: list[BaseException] = []

    def writer(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(50):
            idx.add(_unit(rng, 4), [5, 5, 5, 5], [1, 1, 1, 1])

    def reader(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(200):
                nb = idx.query(_unit(rng, 1)[0], k=8)
                assert np.all(nb.output_tokens == 5)
        except BaseException as exc:  # reported to the main thread
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(3)]
    threads += [threading.Thread(target=reader, args=(10 + i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert idx.added == 600 and len(idx) == 500


def test_save_load_round_trip(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    x = _unit(rng, 30)
    idx = HistoryIndex(DIM, 20)
    idx.add(x, np.arange(30) + 1, np.arange(30))
    path = tmp_path / "h.npz"
    idx.save(path, extra={"note": "hi"})
    assert not [p for p in tmp_path.iterdir() if p.name != "h.npz"]  # no temp left over
    loaded, extra = HistoryIndex.load(path, dim=DIM)
    assert extra == {"note": "hi"} and loaded.added == 30 and len(loaded) == 20
    for q in x[-5:]:
        a, b = idx.query(q, k=3), loaded.query(q, k=3)
        assert np.array_equal(a.output_tokens, b.output_tokens)
    assert read_header(path)["dim"] == DIM


def test_load_refuses_other_dimension(tmp_path: Path) -> None:
    idx = HistoryIndex(DIM, 5)
    idx.add(np.eye(DIM, dtype=np.float32)[:2], [1, 2], [1, 1])
    idx.save(tmp_path / "h.npz")
    with pytest.raises(SnapshotError, match="16-d embeddings but the embedder makes 384-d"):
        HistoryIndex.load(tmp_path / "h.npz", dim=384)


def test_load_refuses_foreign_and_future_files(tmp_path: Path) -> None:
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a snapshot")
    with pytest.raises(SnapshotError, match="cannot read"):
        HistoryIndex.load(junk, dim=DIM)
    other = tmp_path / "other.npz"
    header = np.frombuffer(b'{"format": "sagesched-predictor-history", "version": 99}', np.uint8)
    np.savez(other, header=header)
    with pytest.raises(SnapshotError, match="version 99"):
        HistoryIndex.load(other, dim=DIM)


def test_a_graph_that_reaches_fewer_than_k_items_still_answers() -> None:
    """hnswlib raises when its search reaches fewer than k items (a sparse graph rewired by
    overwritten slots; seen on the default graph under live traffic, reproduced here with a
    tiny one): the query searches wider, then asks for fewer, and answers with its nearest."""
    rng = np.random.default_rng(0)
    h = HistoryIndex(16, 100, m=2, ef_construction=2, ef_search=1)
    for _ in range(40):
        h.add(rng.normal(size=(8, 16)), np.ones(8), np.ones(8))
    probe = rng.normal(size=(5, 16))
    h._index.set_ef(1)
    with pytest.raises(RuntimeError):  # hnswlib alone
        h._index.knn_query(probe, k=50)
    found = h.query_many(probe, 50)
    assert len(found) == 5 and all(0 < len(n.similarity) <= 50 for n in found)
