"""The notebooks run top to bottom (a few steps) in a fresh kernel: the GRPO quickstart (with a
custom reward function) and DPO on a JSONL file."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "grpo_quickstart.ipynb"


def _execute(path: Path, tmp_path: Path) -> nbformat.NotebookNode:
    nb = nbformat.read(path, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code")  # stored clean
    env = dict(os.environ)
    env["JAXRL_NOTEBOOK_QUICK"] = "1"
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
