"""The document-writing workload of the memory-bound regime, built from ShareGPT conversations.

The paper evaluates on a document-writing set (long answers) besides ShareGPT and Alpaca; no
such set is in `shared/data`, so one is made from what is: a ShareGPT conversation of at least
`MIN_ANSWERS` answered turns becomes one request whose prompt is every human turn in order
(the brief, joined by blank lines) and whose answer is every gpt turn (the document, written in
sections). Lengths are the real lengths of those real answers, in MiniLM word pieces like the
other prompt sets (`predictor.datasets`). Measured on the first 6,000 conversations: answers
of median 1,581 tokens (p10 449, p90 2,317; the ShareGPT split files cut conversations near
2,048 tokens), prompts of median 117 (p90 804): a request holds ~1–3k tokens of KV for
thousands of decode steps, so on one H200 serving Qwen3-32B the KV cache, not the 1,024
sequences, bounds the batch.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from predictor.datasets import SHAREGPT_FILE, shared_data_dir, write_jsonl

NAME = "docwriting"
MIN_ANSWERS = 2


def document_pairs(path: Path) -> Iterator[tuple[str, str, str]]:
    """(id, brief, document) for each conversation with at least `MIN_ANSWERS` gpt turns."""
    import gzip
    import json

    with gzip.open(path, "rt", encoding="utf-8") as f:
        conversations = json.load(f)
    seen: set[str] = set()
    for conv in conversations:
        turns = conv.get("conversations") or []
        asks = [
            t["value"] for t in turns if t.get("from") == "human" and t.get("value", "").strip()
        ]
        answers = [
            t["value"] for t in turns if t.get("from") == "gpt" and t.get("value", "").strip()
        ]
        brief = "\n\n".join(asks)
        if len(answers) >= MIN_ANSWERS and asks and brief not in seen:
            seen.add(brief)
            yield str(conv.get("id", "")), brief, "\n\n".join(answers)


def build_split(
    n_train: int, n_test: int, train_path: Path, test_path: Path, *, seed: int = 0
) -> tuple[int, int]:
    """Disjoint train/test JSONL files of document requests (test filled first)."""
    from predictor.embedder import load_tokenizer

    tokenizer = load_tokenizer()
    pairs = list(document_pairs(shared_data_dir() / SHAREGPT_FILE))
    random.Random(seed).shuffle(pairs)
    pairs = pairs[: n_train + n_test]
    briefs = tokenizer([p for _, p, _ in pairs], add_special_tokens=False, verbose=False)
    docs = tokenizer([d for _, _, d in pairs], add_special_tokens=False, verbose=False)
    records: list[dict[str, Any]] = [
        {
            "id": pid,
            "source": NAME,
            "prompt": brief,
            "prompt_tokens": len(p_ids),
            "output_tokens": len(d_ids),
        }
        for (pid, brief, _), p_ids, d_ids in zip(
            pairs, briefs["input_ids"], docs["input_ids"], strict=True
        )
    ]
    test, train = records[:n_test], records[n_test:]
    write_jsonl(train_path, train)
    write_jsonl(test_path, test)
    return len(train), len(test)
