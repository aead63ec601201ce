"""The tree is ruff-clean (lint and format, line length 100), so style is checked in CI."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("args", [["check", "."], ["format", "--check", "."]])
def test_ruff(args):
    ruff = shutil.which("ruff")
    assert ruff, "ruff is part of the test extra: pip install -e '.[test]'"
    result = subprocess.run([ruff, *args], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_trainers_orchestrate_in_short_methods():
    """The GRPO trainer only orchestrates (issue 33): trainers/grpo.py holds at most 300 lines
    and no function or method in trainers/ runs over 60 lines (docstring included)."""
    import ast

    trainers = ROOT / "jaxrl" / "trainers"
    assert len((trainers / "grpo.py").read_text().splitlines()) <= 300
    long = []
    for path in sorted(trainers.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > 60:
                    long.append(f"{path.name}:{node.name} ({length} lines)")
    assert not long, long
