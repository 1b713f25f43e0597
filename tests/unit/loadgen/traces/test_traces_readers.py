"""Every reader on the shared files: row counts and statistics as SOURCES.md states them."""

from __future__ import annotations

import gzip
import itertools
import json
import statistics
from pathlib import Path

import pytest

from loadgen.traces import TraceDataMissing, load_requests, load_windows
from loadgen.traces.azure import parse_timestamp
from loadgen.traces.bailian import read_bailian_jsonl
from loadgen.traces.burstgpt import read_burstgpt_csv


@pytest.mark.parametrize(
    ("source", "rows", "span_s", "mean_in", "mean_out"),
    [
        ("azure-code-2023", 8819, 3436, 2048, 27.9),
        ("azure-conv-2023", 19366, 3502, 1155, 211.1),
    ],
)
def test_azure_2023(
    shared: Path, source: str, rows: int, span_s: float, mean_in: float, mean_out: float
) -> None:
    reqs = load_requests(source)
    assert len(reqs) == rows
    assert reqs[0].arrival_s == 0.0
    assert reqs[-1].arrival_s == pytest.approx(span_s, abs=1.0)
    assert all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(reqs))
    assert statistics.fmean(r.prompt_tokens for r in reqs) == pytest.approx(mean_in, abs=0.5)
    assert statistics.fmean(r.output_tokens for r in reqs) == pytest.approx(mean_out, abs=0.05)
    assert {r.source for r in reqs} == {source}


def test_azure_code_keeps_sub_microsecond_digits(shared: Path) -> None:
    reqs = load_requests("azure-code-2023")
    # rows 1-2: 18:17:03.9799600 and 18:17:04.0319600
    assert reqs[1].arrival_s == pytest.approx(0.052, abs=1e-9)


def test_parse_timestamp_formats() -> None:
    whole, frac = parse_timestamp("2023-11-16 18:17:03.9799600")
    assert (whole, frac) == (1700158623, pytest.approx(0.97996))
    assert parse_timestamp("2024-05-10 00:00:00.009930+00:00") == (1715299200, 0.00993)
    assert parse_timestamp("2024-05-10T02:00:00Z")[0] == 1715299200 + 7200
    assert parse_timestamp("2024-05-10 02:00:00+02:00")[0] == 1715299200
    with pytest.raises(ValueError):
        parse_timestamp("yesterday")


def test_azure_2024_format(tmp_path: Path) -> None:
    """The documented 2024 format, written here (the real files are not shared)."""
    path = tmp_path / "AzureLLMInferenceTrace_conv_1week.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2024-05-10 00:00:00.009930+00:00,4808,10\n"
        "2024-05-10 00:00:00.500000+00:00,374,44\n"
        "2024-05-10 00:00:02.250001+00:00,1020,129\n"
    )
    reqs = load_requests("azure-2024", path)
    assert [r.arrival_s for r in reqs] == pytest.approx([0.0, 0.49007, 2.240071])
    sizes = [(r.prompt_tokens, r.output_tokens) for r in reqs]
    assert sizes == [(4808, 10), (374, 44), (1020, 129)]
    assert {r.source for r in reqs} == {"azure-2024"}
    gz = tmp_path / "trace.csv.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    assert load_requests("azure-2024", gz) == reqs


def test_azure_2024_needs_a_path() -> None:
    with pytest.raises(TraceDataMissing, match="azure-2024"):
        load_requests("azure-2024")


def test_burstgpt_v1_skips_17_failures(shared: Path) -> None:
    reqs = load_requests("burstgpt-v1")
    assert len(reqs) == 400 - 17
    assert all(r.output_tokens > 0 for r in reqs)
    assert (reqs[0].arrival_s, reqs[-1].arrival_s) == (5.0, 37274.0)
    assert statistics.fmean(r.prompt_tokens for r in reqs) == pytest.approx(544, abs=1)
    assert statistics.fmean(r.output_tokens for r in reqs) == pytest.approx(289, abs=1)
    tenants = [r.tenant for r in reqs]
    assert set(tenants) == {"ChatGPT", "GPT-4"}
    assert all(r.session is None for r in reqs)
    raw = shared / "traces/burstgpt/burstgpt_slice.csv.gz"
    everything = read_burstgpt_csv(raw, "burstgpt-v1", skip_failed=False)
    assert len(everything) == 400
    assert sum(r.tenant == "ChatGPT" for r in everything) == 320


def test_burstgpt_v3_sessions(shared: Path) -> None:
    reqs = load_requests("burstgpt-v3")
    assert len(reqs) == 400 - 1
    assert (reqs[0].arrival_s, reqs[-1].arrival_s) == (19440110.0, 19481563.0)
    assert max(r.prompt_tokens for r in reqs) == 25085
    raw = shared / "traces/burstgpt/burstgpt3_slice.csv.gz"
    everything = read_burstgpt_csv(raw, "burstgpt-v3", skip_failed=False)
    with_session = [r for r in everything if r.session is not None]
    assert len(with_session) == 394  # the conversation-log rows; API-log rows have none
    assert len({r.session for r in with_session}) == 135


def test_burstgpt_lengths(shared: Path) -> None:
    reqs = load_requests("burstgpt-lengths")
    assert len(reqs) == 8000
    assert [r.arrival_s for r in reqs[:3]] == [0.0, 1.0, 2.0]
    assert statistics.median(r.output_tokens for r in reqs) == 7
    assert statistics.fmean(r.prompt_tokens for r in reqs) == pytest.approx(362.897875)


def test_bailian_traceb_format(tmp_path: Path) -> None:
    """A small file in the traceB JSONL format, written here (the real one is not shared)."""
    rows = [
        {"chat_id": 10, "parent_chat_id": -1, "timestamp": 0.0, "input_length": 344,
         "output_length": 21, "type": "text", "turn": 1, "hash_ids": [1, 2]},
        {"chat_id": 11, "parent_chat_id": -1, "timestamp": 0.044, "input_length": 1241,
         "output_length": 103, "type": "search", "turn": 1, "hash_ids": [3]},
        {"chat_id": 12, "parent_chat_id": 10, "timestamp": 1.5, "input_length": 700,
         "output_length": 40, "type": "text", "turn": 2, "hash_ids": [1, 2, 4]},
        {"chat_id": 13, "parent_chat_id": 12, "timestamp": 1.2, "input_length": 900,
         "output_length": 0, "type": "text", "turn": 3, "hash_ids": [1, 2, 4, 5]},
    ]  # fmt: skip
    path = tmp_path / "qwen_traceB_blksz_16.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    reqs = load_requests("bailian-traceb", path)
    assert [r.arrival_s for r in reqs] == [0.0, 0.044, 1.2, 1.5]  # sorted by timestamp
    assert [r.prompt_tokens for r in reqs] == [344, 1241, 900, 700]
    assert [r.session for r in reqs] == ["10", "11", "10", "10"]  # follows parent_chat_id
    assert reqs[2].output_tokens == 0
    assert read_bailian_jsonl(path, "x")[0].source == "x"
    windows = load_windows("bailian-traceb", path=path, n_requests=2, count=2)
    assert [len(w) for w in windows] == [2, 2]


def test_bailian_rejects_rows_without_lengths(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 1.0, "input_length": 5}\n')
    with pytest.raises(ValueError, match="output_length"):
        load_requests("bailian-traceb", path)


def test_missing_shared_data_names_path_and_variable(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("SAGESCHED_SHARED_DATA", str(tmp_path / "nowhere"))
    with pytest.raises(TraceDataMissing, match="SAGESCHED_SHARED_DATA") as err:
        load_requests("azure-conv-2023")
    assert "nowhere" in str(err.value)
    with pytest.raises(TraceDataMissing, match="SAGESCHED_SHARED_DATA"):
        load_requests("servegen-language")
    with pytest.raises(TraceDataMissing):
        load_windows("azure-conv-2023", count=3)  # not the frozen parameters


def test_unknown_source() -> None:
    with pytest.raises(KeyError, match="azure-conv-2023"):
        load_requests("azure-conv-2025")
