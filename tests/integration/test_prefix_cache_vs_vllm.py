"""The engine model's prefix cache against the real vLLM CPU build (slow).

A few conversations of token-id prompts, re-sent turn by turn (turn k = turns 1..k, so each
turn extends the previous one; every conversation opens with one shared system prompt), are
sent one at a time to the real server (block size 128 on the CPU build) and fed in the same
order to the engine model with the same token ids, hashed in 128-token blocks. The prefix
cache hit ratio from vLLM's own counters (`vllm:prefix_cache_hits_total` /
`vllm:prefix_cache_queries_total`, deltas over the test) and from the engine model's
counters must agree within 5 points. The figures go to `.cache/prefix-cache-vs-vllm.json`.

Twice: on the server's default KV (4,096 blocks: nothing is evicted), and on a server with
only `SMALL_KV_BLOCKS` blocks (`--num-gpu-blocks-override`), where later turns find parts of
their prefix evicted, so the order in which the block pool reuses free blocks decides the
hits. The counters measured are pinned in `fixtures.prefix_prompts.VLLM_MEASURED`, which a
unit test checks the model against without a server.
"""

from __future__ import annotations

import json
import urllib.request

import pytest
from fixtures.prefix_prompts import (
    MAX_TOKENS,
    SMALL_KV_BLOCKS,
    conversations,
    model_counters,
    send_order,
)

from loadgen.vllm_real import CACHE, RealVllm
from loadgen.vllm_real import prefix_cache_counters as _counters

pytestmark = pytest.mark.slow

TOLERANCE = 0.05


def _complete(server: RealVllm, prompt: list[int]) -> None:
    body = {"model": server.name, "prompt": prompt, "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "temperature": 0}  # fmt: skip
    req = urllib.request.Request(
        server.url + "/v1/completions", json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.status == 200


def _compare(server: RealVllm, kv_blocks: int, tag: str) -> None:
    prompts = send_order(conversations())
    assert max(map(len, prompts)) + MAX_TOKENS <= server.max_model_len
    q0, h0 = _counters(server.url)
    for ids in prompts:
        _complete(server, ids)
    q1, h1 = _counters(server.url)
    vllm_q, vllm_h = q1 - q0, h1 - h0
    model_q, model_h = model_counters(prompts, kv_blocks)
    result = {
        "kv_blocks": kv_blocks,
        "prompts": len(prompts),
        "vllm": {"queries": vllm_q, "hits": vllm_h, "ratio": vllm_h / vllm_q},
        "model": {"queries": model_q, "hits": model_h, "ratio": model_h / model_q},
    }
    CACHE.mkdir(parents=True, exist_ok=True)
    path = CACHE / "prefix-cache-vs-vllm.json"
    saved = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**saved, tag: result}, indent=1) + "\n")
    print(result)
    assert vllm_q == model_q  # the same prompt tokens looked up
    assert abs(result["vllm"]["ratio"] - result["model"]["ratio"]) <= TOLERANCE


def test_hit_ratio_matches_vllm(real_vllm: RealVllm) -> None:
    _compare(real_vllm, 4096, "default_kv")


def test_hit_ratio_matches_vllm_small_kv() -> None:
    """With evictions: the server holds `SMALL_KV_BLOCKS` blocks."""
    args = ("--num-gpu-blocks-override", str(SMALL_KV_BLOCKS))
    with RealVllm(extra_args=args, log_path=CACHE / "vllm-small-kv.log") as server:
        _compare(server, SMALL_KV_BLOCKS, "small_kv")
