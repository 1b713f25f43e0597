"""Build `{prompt, output_tokens, prompt_tokens}` JSONL files from the shared prompt sets.

Sources (see shared/data/SOURCES.md): ShareGPT (the first human turn of a conversation, answered
by the gpt turn right after it), Alpaca (instruction + input → output) and MT-Bench (each turn
of the 30 questions with a GPT-4 reference answer; 60 records, a test set only). Token counts come
from the BERT word-piece tokenizer bundled with the MiniLM package (`predictor.embedder.
load_tokenizer`), offline. It only approximates the serving model's tokenizer (Llama/Qwen BPE
counts differ by roughly ±20% on English text), which is fine for learning *relative* lengths;
in production the gateway observes the server's own usage counts instead.

Exact duplicate prompts are dropped before the shuffle, so no test prompt also sits in train.
"""

from __future__ import annotations

import gzip
import json
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
SHAREGPT_FILE = "prompts/sharegpt/ShareGPT_V3_unfiltered_cleaned_split.part-first17671.json.gz"
ALPACA_FILE = "prompts/alpaca/alpaca_5000.json.gz"
MT_BENCH_QUESTIONS = "prompts/mt_bench/question.jsonl.gz"
MT_BENCH_ANSWERS = "prompts/mt_bench/reference_answer/gpt-4.jsonl.gz"
SOURCES = ("sharegpt", "alpaca", "mt_bench", "docwriting")
DOC_MIN_ANSWERS = 2


def shared_data_dir() -> Path:
    """$SAGESCHED_SHARED_DATA, else the `shared/data` folder beside the repository."""
    env = os.environ.get("SAGESCHED_SHARED_DATA")
    return Path(env) if env else REPO_ROOT.parent / "shared" / "data"


def _load_json_gz(path: Path) -> Any:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return json.load(f)


def sharegpt_pairs(path: Path) -> Iterator[tuple[str, str, str]]:
    """(id, prompt, response) for each conversation whose first human turn is answered by
    the next turn from gpt; empty texts are skipped."""
    for conv in _load_json_gz(path):
        turns = conv.get("conversations") or []
        for i, turn in enumerate(turns[:-1]):
            if turn.get("from") != "human":
                continue
            reply = turns[i + 1]
            prompt, answer = turn.get("value") or "", reply.get("value") or ""
            if reply.get("from") == "gpt" and prompt.strip() and answer.strip():
                yield str(conv.get("id", "")), prompt, answer
            break


def alpaca_pairs(path: Path) -> Iterator[tuple[str, str, str]]:
    """(index, instruction [+ blank line + input], output) for each Alpaca example."""
    for i, row in enumerate(_load_json_gz(path)):
        prompt = row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")
        if row.get("output", "").strip():
            yield str(i), prompt, row["output"]


def mt_bench_pairs(questions: Path, answers: Path) -> Iterator[tuple[str, str, str]]:
    """(question_id/turn, user turn, GPT-4 reference answer) for every turn of the 30
    questions that have a reference answer (math, reasoning, coding): 60 pairs. A second turn
    is embedded alone, as `predictor.request_text` embeds the last user turn of a chat."""
    with gzip.open(questions, "rt", encoding="utf-8") as f:
        turns = {q["question_id"]: q["turns"] for q in map(json.loads, f) if q}
    with gzip.open(answers, "rt", encoding="utf-8") as f:
        for row in map(json.loads, f):
            asked = turns.get(row["question_id"], [])
            for t, (prompt, answer) in enumerate(
                zip(asked, row["choices"][0]["turns"], strict=False)
            ):
                if prompt.strip() and answer.strip():
                    yield f"{row['question_id']}/{t + 1}", prompt, answer


def document_pairs(path: Path) -> Iterator[tuple[str, str, str]]:
    """`docwriting`: (id, brief, document) for each ShareGPT conversation with at least
    `DOC_MIN_ANSWERS` answered turns. The brief is every human turn in order, the document
    every gpt turn (written in sections), each joined by blank lines: a long-answer,
    document-writing-like set made from real answers (the paper's document-writing set is not
    in shared/data). Measured on the first 6,000 conversations: answers of median 1,581 word
    pieces (p10 449, p90 2,317; the split files cut conversations near 2,048 tokens), briefs of
    median 117 (p90 804)."""
    for conv in _load_json_gz(path):
        turns = [t for t in conv.get("conversations") or [] if (t.get("value") or "").strip()]
        asks = [t["value"] for t in turns if t.get("from") == "human"]
        answers = [t["value"] for t in turns if t.get("from") == "gpt"]
        if len(answers) >= DOC_MIN_ANSWERS and asks:
            yield str(conv.get("id", "")), "\n\n".join(asks), "\n\n".join(answers)


def load_pairs(source: str, data_dir: Path | None = None) -> list[tuple[str, str, str]]:
    """Deduplicated (id, prompt, response) pairs of a source, in file order."""
    base = data_dir or shared_data_dir()
    if source == "sharegpt":
        pairs = sharegpt_pairs(base / SHAREGPT_FILE)
    elif source == "alpaca":
        pairs = alpaca_pairs(base / ALPACA_FILE)
    elif source == "docwriting":
        pairs = document_pairs(base / SHAREGPT_FILE)
    elif source == "mt_bench":
        pairs = mt_bench_pairs(base / MT_BENCH_QUESTIONS, base / MT_BENCH_ANSWERS)
    else:
        raise ValueError(f"unknown source {source!r}; known: {', '.join(SOURCES)}")
    seen: set[str] = set()
    out = []
    for pid, prompt, answer in pairs:
        if prompt not in seen:
            seen.add(prompt)
            out.append((pid, prompt, answer))
    return out


def build_records(
    source: str, n_items: int, seed: int, tokenizer: Any, data_dir: Path | None = None
) -> list[dict[str, Any]]:
    """`n_items` shuffled records `{id, source, prompt, prompt_tokens, output_tokens}`
    (fewer if the source has fewer)."""
    pairs = load_pairs(source, data_dir)
    random.Random(seed).shuffle(pairs)
    pairs = pairs[:n_items]
    prompts = tokenizer([p for _, p, _ in pairs], add_special_tokens=False, verbose=False)
    answers = tokenizer([a for _, _, a in pairs], add_special_tokens=False, verbose=False)
    return [
        {
            "id": pid,
            "source": source,
            "prompt": prompt,
            "prompt_tokens": len(p_ids),
            "output_tokens": len(a_ids),
        }
        for (pid, prompt, _), p_ids, a_ids in zip(
            pairs, prompts["input_ids"], answers["input_ids"], strict=True
        )
        if len(a_ids) > 0
    ]


def write_jsonl(path: str | os.PathLike[str], records: list[dict[str, Any]]) -> None:
    """Write records one JSON object per line (UTF-8)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    with target.open("w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")


def build_split(
    source: str,
    n_train: int,
    n_test: int,
    train_path: str | os.PathLike[str],
    test_path: str | os.PathLike[str],
    *,
    seed: int = 0,
    tokenizer: Any = None,
    data_dir: Path | None = None,
) -> tuple[int, int]:
    """Write a disjoint train/test pair of JSONL files; returns their sizes. The test set is
    filled first, so when the source runs short, train is the one that shrinks."""
    if tokenizer is None:
        from predictor.offline import load_tokenizer

        tokenizer = load_tokenizer()
    records = build_records(source, n_train + n_test, seed, tokenizer, data_dir)
    test, train = records[:n_test], records[n_test : n_test + n_train]
    write_jsonl(train_path, train)
    write_jsonl(test_path, test)
    return len(train), len(test)
