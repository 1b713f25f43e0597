"""`gateway.serving.drain.reload_keys`: what SIGHUP applies from a fresh read of the config file —
client, admin and class keys only; an invalid file keeps the old keys and logs no key."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from gateway.config import load
from gateway.serving.drain import KeySource, reload_keys

BASE = "backends: [{url: 'http://b:8000'}]\npolicy: fcfs\n"
CLASSES = ("classes:\n  list:\n    - {name: interactive, priority: 0, api_keys: [%s]}\n"
           "    - {name: standard, priority: 1}\n  default: standard\n")  # fmt: skip


def test_keys_of_the_file_are_applied_and_nothing_else(tmp_path: Path) -> None:
    path = tmp_path / "gw.yaml"
    path.write_text(BASE + "api_keys: [a1, a2]\nadmin_key: adm1\n" + CLASSES % "c1")
    current = load(str(path))
    path.write_text(BASE.replace("fcfs", "sjf-oracle") + "api_keys: [a2, a3]\nadmin_key: adm2\n"
                    + CLASSES % "c2" + "max_waiting: 5\n")  # fmt: skip
    updated = reload_keys(current, KeySource(str(path)))
    assert updated is not None
    assert updated.api_keys == ("a2", "a3") and updated.admin_key == "adm2"
    assert [c.api_keys for c in updated.classes.list] == [("c2",), ()]
    assert updated.policy == "fcfs" and updated.max_waiting == current.max_waiting


@pytest.mark.parametrize(
    "text",
    [
        "api_keys: [a9\n  - : broken",  # YAML
        BASE + "api_keys: [a9]\nmax_waiting: nope\n",  # a wrong type
        BASE + "api_keys: [a9]\nclasses: {list: [{name: other}], default: other}\n",  # renamed
    ],
)
def test_an_invalid_file_keeps_the_keys_and_logs_none(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, text: str
) -> None:
    path = tmp_path / "gw.yaml"
    path.write_text(BASE + "api_keys: [a1]\nadmin_key: adm1\n")
    current = load(str(path))
    path.write_text(text)
    with caplog.at_level(logging.INFO):
        assert reload_keys(current, KeySource(str(path))) is None
    assert "not reloaded" in caplog.text
    assert "a1" not in caplog.text and "a9" not in caplog.text and "adm1" not in caplog.text


def test_flags_still_win_over_the_file(tmp_path: Path) -> None:
    path = tmp_path / "gw.yaml"
    path.write_text(BASE + "api_keys: [a1]\n")
    source = KeySource(str(path), {"api_keys": ["flag"]})
    current = source.load()
    path.write_text(BASE + "api_keys: [a2]\n")
    updated = reload_keys(current, source)
    assert updated is not None and updated.api_keys == ("flag",)
