"""The GRPO quickstart notebook runs top to bottom (a few steps) in a fresh kernel."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "grpo_quickstart.ipynb"


def test_grpo_quickstart_notebook_executes(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
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

    out = tmp_path / "runs" / "grpo_quickstart"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # 3 GRPO steps + 1 on external rollouts
    assert rows[2]["eval/accuracy"] is not None and rows[2]["eval/accuracy_sampled"] is not None
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
