"""The public surface and the dependency rule of `predictor`."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import predictor
import sagesched_cli

PACKAGE = Path(predictor.__file__).resolve().parent
HEAVY = ("torch", "sentence_transformers", "transformers", "hnswlib", "scipy")


def test_all_is_sorted_and_importable() -> None:
    assert len(set(predictor.__all__)) == len(predictor.__all__)
    for name in predictor.__all__:
        assert getattr(predictor, name) is not None


def test_import_is_cheap() -> None:
    code = "import json, sys, predictor; "
    code += f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_never_imports_gateway_or_loadgen() -> None:
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] not in ("gateway", "loadgen"), f"{path}: {name}"


def test_cli_is_registered() -> None:
    assert sagesched_cli.COMMANDS["predictor"][0] == "predictor.cli"
