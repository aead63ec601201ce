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
