"""The docs cannot drift from the code: paths they name exist, commands they mark runnable
run, and they read as pages for users (no session or issue-part numbers).

`make docs` (mkdocs --strict) checks links and anchors between pages; this checks what mkdocs
cannot see: the repository files a page names and the commands it shows. A fenced block
marked runnable (```` ```{.bash .runnable} ````) is run line by line from the repository root
(`python` is this interpreter, the project's console scripts are on PATH)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [*sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md"]
OURS = ("bench", "deploy", "docs", "gateway", "loadgen", "policies", "predictor", "tests")
"""Top-level folders of this repository: a path a page names under one of them must exist."""
HISTORY = re.compile(
    r"\bsession \d+|\bissue \d+|\bpart \d+ of (the|issue)|\bissue[- ]part|another engineer"
    r"|other engineers|\bload average",
    re.IGNORECASE,
)
RUNNABLE = re.compile(r"^```\{\.bash \.runnable\}\n(.*?)^```", re.MULTILINE | re.DOTALL)
MIN_RUNNABLE = 5
"""Runnable commands the docs show at least (a check over none would pass on anything)."""


def named_paths(text: str) -> set[str]:
    """Repository paths a page names in backticks or links (`gateway/app.py`)."""
    found = set(re.findall(r"`([A-Za-z0-9_.\-]+(?:/[A-Za-z0-9_.\-]+)+)`", text))
    found |= set(re.findall(r"\]\(([A-Za-z0-9_.\-]+(?:/[A-Za-z0-9_.\-]+)+)(?:#[^)]*)?\)", text))
    return {p for p in found if p.split("/")[0] in OURS}


def runnable_commands() -> list[tuple[str, str]]:
    """(page, command) for every line of every runnable block."""
    commands = []
    for page in PAGES:
        for block in RUNNABLE.findall(page.read_text()):
            for line in block.splitlines():
                line = line.split(" # ")[0].strip()
                if line and not line.startswith("#"):
                    commands.append((page.relative_to(ROOT).as_posix(), line))
    return commands


def test_pages_name_paths_that_exist() -> None:
    missing = [
        f"{page.relative_to(ROOT)}: {path}"
        for page in PAGES
        for path in sorted(named_paths(page.read_text()))
        if not (ROOT / path).exists() and not (page.parent / path).exists()
    ]
    assert not missing, missing


def test_pages_carry_no_history() -> None:
    hits = [
        f"{page.relative_to(ROOT)}:{n}: {line.strip()}"
        for page in PAGES
        for n, line in enumerate(page.read_text().splitlines(), 1)
        if HISTORY.search(line)
    ]
    assert not hits, hits


def test_the_checks_see_what_they_check() -> None:
    assert named_paths("see `gateway/app.py` and [x](policies/base.py#y), not `x/y.py`") == {
        "gateway/app.py",
        "policies/base.py",
    }
    assert HISTORY.search("found in session 27") and not HISTORY.search("a session header")
    assert len(runnable_commands()) >= MIN_RUNNABLE


@pytest.mark.parametrize("page,command", runnable_commands())
def test_runnable_command(page: str, command: str) -> None:
    argv = shlex.split(command)
    if argv[0] == "python":
        argv[0] = sys.executable
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(
        argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, f"{page}: {command}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
    assert proc.stdout.strip(), f"{page}: {command} printed nothing"
