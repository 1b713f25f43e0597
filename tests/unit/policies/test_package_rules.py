"""The dependency rule and the public surface of `policies`."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import policies

ROOT = Path(__file__).resolve().parents[3]


def test_imports_only_stdlib_and_numpy() -> None:
    code = (
        "import sys, json; before = set(sys.modules); "
        "import policies, policies.catalog, policies.routing, policies.routing.catalog; "
        "print(json.dumps(sorted(set(sys.modules) - before)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = json.loads(out.stdout)
    top = {m.split(".")[0] for m in loaded}
    foreign = top - set(sys.stdlib_module_names) - {"numpy", "policies"}
    assert not foreign, f"policies pulled in {sorted(foreign)}"
    assert "asyncio" not in top


def test_no_clocks_or_io_in_policies() -> None:
    banned = re.compile(
        r"\b(time\.(time|monotonic|perf_counter)|datetime\.now|import asyncio|asyncio\.|open\()"
    )
    offenders = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "policies").rglob("*.py")
        if p.name != "cli.py" and banned.search(p.read_text())
    ]
    assert not offenders


def test_public_surface() -> None:
    assert sorted(policies.__all__) == sorted(set(policies.__all__))
    for name in policies.__all__:
        assert hasattr(policies, name), name
    from policies import gittins_index

    assert gittins_index([1.0, 2.0], [0.5, 0.5], 0.0) > 0


def test_routing_public_surface() -> None:
    import policies.routing as routing

    assert sorted(routing.__all__) == sorted(set(routing.__all__))
    for name in routing.__all__:
        assert hasattr(routing, name), name


def test_cli_lists_routers() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "sagesched_cli", "routers", "--json"],
        capture_output=True, text=True, check=True, cwd=ROOT,
    )  # fmt: skip
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    expected = {"least-loaded", "round-robin", "random", "session", "prefix", "cache-aware"}
    assert expected | {"sagesched"} <= set(rows)
    assert rows["prefix"]["params"]["prefix_weight"]["default"] == 3.0
    assert rows["prefix"]["uses_prefix"] and not rows["round-robin"]["uses_prefix"]


def test_cli_lists_catalog() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "sagesched_cli", "policies", "--json"],
        capture_output=True, text=True, check=True, cwd=ROOT,
    )  # fmt: skip
    rows = json.loads(out.stdout)
    assert len(rows) >= 13
    assert all(r["description"] for r in rows)
    assert {"sagesched", "fcfs", "vtc"} <= {r["name"] for r in rows}
    bad = subprocess.run(
        [sys.executable, "-m", "sagesched_cli", "nope"], capture_output=True, cwd=ROOT
    )
    assert bad.returncode == 2
