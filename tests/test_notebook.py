"""The notebooks run top to bottom (a few steps) in a fresh kernel: the GRPO quickstart (with a
custom reward function) and DPO on a JSONL file. They use only jaxrl's public API (``import
jaxrl`` and its ``__all__``), so they also run from a non-editable install: the slow
``test_notebooks_run_from_an_installed_wheel`` builds a wheel into a fresh virtual environment
and runs this file's notebook tests there, from outside the checkout.

By hand, the same check: ``python -m venv --system-site-packages /tmp/v && /tmp/v/bin/pip
install --no-deps .``, then from another directory ``JAXRL_NOTEBOOK_INSTALLED=1 /tmp/v/bin/python
-m pytest <checkout>/tests/test_notebook.py -k executes -n 0``."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "grpo_quickstart.ipynb"
NOTEBOOKS = sorted(NOTEBOOK.parent.glob("*.ipynb"))


def _execute(path: Path, tmp_path: Path) -> nbformat.NotebookNode:
    nb = nbformat.read(path, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code")  # stored clean
    env = dict(os.environ)
    env["JAXRL_NOTEBOOK_QUICK"] = "1"
    if os.environ.get("JAXRL_NOTEBOOK_INSTALLED") == "1":  # the kernel must import the wheel
        env.pop("PYTHONPATH", None)
        where = subprocess.run(
            [sys.executable, "-c", "import jaxrl; print(jaxrl.__file__)"],
            cwd=tmp_path, env=env, capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        assert not Path(where).resolve().is_relative_to(ROOT), f"jaxrl from the checkout: {where}"
    env.pop("XLA_FLAGS", None)  # a fresh kernel sees one CPU device, as on a laptop (the suite's
    # 8 host devices would not match the config's mesh.data=1)
    env.setdefault(
        "JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "jaxrl-test-jax-cache")
    )
    client = NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute(env=env)  # raises CellExecutionError, with the cell's traceback, on failure
    return nb


@pytest.mark.slow
def test_grpo_quickstart_notebook_executes(tmp_path):
    nb = _execute(NOTEBOOK, tmp_path)

    out = tmp_path / "runs" / "grpo_quickstart"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # 3 GRPO steps + 1 on external rollouts
    assert rows[2]["eval/accuracy"] is not None and rows[2]["eval/accuracy_sampled"] is not None
    assert all("rewards/short_answer/mean" in r for r in rows[:3])  # the notebook's own reward
    assert (out / "grpo_progress.png").stat().st_size > 1000
    images = [
        o
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
        if "image/png" in o.get("data", {})
    ]
    assert len(images) >= 2  # the trainer's PNG and the metrics figure
    summary = next(
        o["data"]["text/plain"]
        for c in nb.cells
        if c.cell_type == "code" and "summary = trainer.run()" in c.source
        for o in c.outputs
        if "text/plain" in o.get("data", {})
    )
    assert "eval/accuracy_start" in summary and "eval/accuracy_sampled_start" in summary


@pytest.mark.slow
def test_dpo_jsonl_notebook_executes(tmp_path):
    nb = _execute(NOTEBOOK.parent / "dpo_jsonl.ipynb", tmp_path)
    out = tmp_path / "runs" / "dpo_jsonl"
    assert (out / "sft" / "hf" / "tokenizer.json").is_file()
    lines = (out / "data" / "train.jsonl").read_text().splitlines()
    assert len(lines) == 1024 and set(json.loads(lines[0])) == {"prompt", "chosen", "rejected"}
    rows = [json.loads(line) for line in (out / "dpo" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert abs(steps[0]["loss"] - 0.6931) < 1e-3  # policy == reference at the first step
    assert rows[-1]["eval/accuracy"] is not None
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if "image/png" in o.get("data", {})]  # fmt: skip
    assert images


def _public_names() -> set[str]:
    import jaxrl

    return set(jaxrl.__all__)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebooks_use_only_the_public_api(path):
    """A notebook imports ``jaxrl`` itself and reads only its public names (``jaxrl.__all__``):
    no ``from jaxrl.x import``, no ``jaxrl.x.y`` path into the modules behind them, no path
    built from ``jaxrl.__file__`` (an installed wheel has no ``configs/`` beside it)."""
    public, bad = _public_names(), []
    for cell in nbformat.read(path, as_version=4).cells:
        if cell.cell_type != "code":
            continue
        for node in ast.walk(ast.parse(cell.source)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxrl"):
                bad.append(f"from {node.module} import ...")
            elif isinstance(node, ast.Import):
                bad += [a.name for a in node.names if a.name.startswith("jaxrl.")]
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "jaxrl"
                and node.attr not in public
            ):
                bad.append(f"jaxrl.{node.attr}")
    assert not bad, f"{path.name} reaches past the public API: {bad}"
    assert "import jaxrl" in "".join(c.source for c in nbformat.read(path, as_version=4).cells)


def test_the_public_api_resolves():
    """Every public name imports (a module moved behind it breaks this, not a notebook), and
    ``import jaxrl`` imports none of them (no jax) until one is used."""
    import jaxrl

    code = "import sys, jaxrl; print(sorted(m for m in sys.modules if m.startswith('jax')))"
    light = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert light.stdout.strip() == "['jaxrl']", light.stdout
    for name in jaxrl.__all__:
        assert getattr(jaxrl, name) is not None, name
    assert jaxrl.configs.path("grpo_tiny").name == "grpo_tiny.yaml"
    assert jaxrl.configs.path("sft_tiny.yaml") == jaxrl.configs.directory() / "sft_tiny.yaml"
    assert {"grpo_tiny", "sft_tiny", "dpo_tiny"} <= set(jaxrl.configs.names())
    with pytest.raises(FileNotFoundError, match="the shipped configs are .*grpo_tiny"):
        jaxrl.configs.path("grpo_tiyn")
    with pytest.raises(AttributeError):
        jaxrl.no_such_name  # noqa: B018


@pytest.mark.slow
def test_notebooks_run_from_an_installed_wheel(tmp_path):
    """``pip install .`` (not editable) into a fresh virtual environment that borrows this
    interpreter's packages, then the notebook tests under that environment's Python from a
    directory outside the checkout: the kernel imports the wheel (checked), whose
    ``jaxrl.configs`` carries the shipped YAML files."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    python = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    pip = [str(python), "-m", "pip", "install", "-q", "--no-deps", str(ROOT)]
    # pip's isolated build fetches setuptools and wheel; offline, build with this interpreter's
    built = subprocess.run(pip, env=env, capture_output=True, text=True)
    if built.returncode != 0:
        offline = subprocess.run(
            [*pip, "--no-build-isolation"], env=env, capture_output=True, text=True
        )
        assert offline.returncode == 0, built.stderr[-3000:] + offline.stderr[-3000:]
    env["JAXRL_NOTEBOOK_INSTALLED"] = "1"
    run = subprocess.run(
        [str(python), "-m", "pytest", str(Path(__file__).resolve()), "-k", "executes",
         "-n", "0", "-q", "-p", "no:cacheprovider", "-m", "slow"],
        cwd=tmp_path, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert "2 passed" in run.stdout, run.stdout[-2000:]
