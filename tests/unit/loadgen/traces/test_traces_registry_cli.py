"""The source registry (stable names, loud duplicates) and `sagesched traces`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import loadgen.traces.cli as cli
from loadgen.traces import list_sources, load_windows, register_source, source_names
from loadgen.traces.lssp import LsspSource

STABLE_NAMES = {
    "azure-code-2023",
    "capture",
    "azure-conv-2023",
    "azure-2024",
    "burstgpt-v1",
    "burstgpt-v3",
    "burstgpt-lengths",
    "servegen-language",
    "servegen-reason",
    "servegen-multimodal",
    "bailian-traceb",
    "lssp-azure2024",
    "lssp-bailian",
    "lssp-burstgpt",
    "mooncake-conversation",
    "mooncake-synthetic",
}


def test_registry_holds_the_stable_names() -> None:
    assert set(source_names()) == STABLE_NAMES
    infos = {i.name: i for i in list_sources()}
    assert {n for n, i in infos.items() if i.needs_path} == {
        "azure-2024",
        "bailian-traceb",
        "capture",
    }
    assert infos["burstgpt-lengths"].has_arrivals is False
    assert all(i.description for i in infos.values())


def test_registering_a_name_twice_is_an_error() -> None:
    with pytest.raises(ValueError, match="twice"):
        register_source(LsspSource("lssp-bailian"))


def test_package_imports_only_stdlib_and_numpy() -> None:
    """`policies` is allowed: standard library and numpy only, and the block-hash chains of
    Mooncake and session prompts are its `policies.routing.chain`."""
    code = (
        "import sys, loadgen.traces, loadgen.traces.cli;"
        "bad = [m for m in sys.modules if m.split('.')[0] in "
        "('scipy', 'pandas', 'torch', 'aiohttp', 'predictor', 'gateway')];"
        "print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_cli_lists_every_source(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([], prog="sagesched traces") == 0
    out = capsys.readouterr().out
    for name in STABLE_NAMES:
        assert name in out
    assert "lssp-azure2024" in out and " 39 " in out


def test_cli_shows_knees_when_a_manifest_exists(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    knees = tmp_path / "lssp-bailian.csv"
    first = load_windows("lssp-bailian")[0].window_id
    knees.write_text(f"window_id,knee\n{first},55.7\n")
    monkeypatch.setattr(cli, "knees_path", lambda source: tmp_path / f"{source}.csv")
    assert cli.main(["lssp-bailian", "burstgpt-v1"], prog="t") == 0
    lines = capsys.readouterr().out.splitlines()
    row = next(line for line in lines if first in line)
    assert row.rstrip().endswith("55.7")
    others = [line for line in lines if "bailian_qwen_" in line and first not in line]
    assert len(others) == 39 and all(line.rstrip().endswith("-") for line in others)
    assert any("burstgpt-v1_s0_w00" in line for line in lines)


def test_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--json", "lssp-burstgpt"], prog="t") == 0
    out = json.loads(capsys.readouterr().out)
    assert [s["name"] for s in out] == ["lssp-burstgpt"]
    assert len(out[0]["windows"]) == 40 and out[0]["windows"][0]["requests"] == 200


def test_cli_rejects_unknown_sources(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["no-such-source"], prog="t") == 2
    assert "no-such-source" in capsys.readouterr().err


def test_console_script_dispatches() -> None:
    import sagesched_cli

    assert sagesched_cli.COMMANDS["traces"][0] == "loadgen.traces.cli"
