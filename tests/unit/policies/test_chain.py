"""Block-hash chains (`policies.routing.chain`): chained, deterministic, 63-bit, full blocks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from policies.routing.chain import (
    ROOT,
    chain,
    chain_ids,
    chain_text,
    chain_tokens,
    shared_blocks,
)

REPO = str(Path(__file__).resolve().parents[3])


def test_entry_k_covers_the_whole_prefix() -> None:
    a = chain_ids([1, 2, 3])
    b = chain_ids([9, 2, 3])  # same blocks 1 and 2, different block 0
    assert a[0] != b[0] and a[1] != b[1] and a[2] != b[2]
    assert chain_ids([1, 2, 4])[:2] == a[:2]
    assert a[1] == chain(a[0], (2).to_bytes(8, "little", signed=True))
    assert a[0] == chain(ROOT, (1).to_bytes(8, "little", signed=True))


def test_full_blocks_only_and_shared_prefix() -> None:
    ids = list(range(100, 150))
    assert len(chain_tokens(ids, 16)) == 3  # 50 tokens: 3 full blocks, 2 left over
    assert len(chain_tokens(ids[:15], 16)) == 0
    other = ids[:40] + [7] * 10
    assert shared_blocks(chain_tokens(ids, 16), chain_tokens(other, 16)) == 2
    assert shared_blocks(chain_tokens(ids, 16), chain_tokens(ids, 8)) == 0  # other block size


def test_values_fit_in_63_bits_and_are_not_negative() -> None:
    hashes = chain_ids(range(-5, 2000)) + chain_tokens(list(range(30000)), 16)
    assert all(0 <= h < 2**63 for h in hashes)
    assert len(set(hashes)) == len(hashes)


def test_deterministic_across_processes() -> None:
    """Not Python's salted `hash()`: another interpreter with another seed agrees."""
    code = (
        "from policies.routing.chain import chain_tokens; print(chain_tokens(list(range(64)), 16))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "12345", "PATH": ""},
        cwd=REPO,
    ).stdout
    assert out.strip() == str(chain_tokens(list(range(64)), 16))


def test_text_blocks_share_a_conversations_prefix() -> None:
    """Turn 2 resends turn 1 and its answer: their full character blocks chain alike."""
    turn1 = "system: be brief\nuser: " + "tell me about the sea " * 10
    turn2 = turn1 + "\nassistant: it is wide\nuser: and deep?"
    a, b = chain_text(turn1, 16), chain_text(turn2, 16)
    assert len(a) == len(turn1) // 16 and len(b) == len(turn2) // 16
    assert shared_blocks(a, b) == len(a)
    assert shared_blocks(a, chain_text("x" + turn1, 16)) == 0  # one character in front
    assert chain_text("é" * 70) == chain_text("é" * 64)  # two full 64-byte blocks
    assert len(chain_text("é" * 64)) == 2 and len(set(chain_text("ab" * 4000))) == 125
    assert chain_text("short") == ()
