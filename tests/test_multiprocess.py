"""Multi-process = single process: two processes × 4 host devices over gloo, started the way a
TPU pod or GPU cluster starts them (every process runs the same ``jaxrl train CONFIG`` with its
``distributed.*`` settings), train exactly as one process × 8 devices."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_scale_out import JOBS, _run

ROOT = Path(__file__).resolve().parents[1]
GLOBAL = {  # per-device batch fields that make the jobs' global batch on 8 ranks
    "grpo": ["grpo.per_device_train_batch_size=2"],
    "dpo": ["dpo.per_device_train_batch_size=2"],
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(out: Path, config: str, sets: list[str]) -> list[subprocess.CompletedProcess]:
    """Both processes of a 2-host job, 4 CPU devices each, sharing one output directory."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    procs = []
    for pid in range(2):
        args = [sys.executable, "-m", "jaxrl.cli", "train", config]
        for o in [
            f"output_dir={out}",
            "logging.progress=false",
            "mesh.data=8",
            f"distributed.coordinator_address=127.0.0.1:{port}",
            "distributed.num_processes=2",
            f"distributed.process_id={pid}",
            *sets,
        ]:
            args += ["--set", o]
        procs.append(
            subprocess.Popen(
                args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    done = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=900)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return done


@pytest.mark.slow
@pytest.mark.parametrize("job", sorted(JOBS))
def test_two_processes_train_as_one(tmp_path, job):
    config, sets = JOBS[job]
    sets = [*sets, *GLOBAL.get(job, [])]
    single = _run(tmp_path / "single", config, *sets, "mesh.data=8")
    out = tmp_path / "multi"
    first, second = _launch(out, config, sets)
    for p in (first, second):
        assert p.returncode == 0, p.stderr[-3000:]
    # process 0 prints the run's summary (gloo's C++ threads may print into the same stream)
    assert '"steps": 3' in first.stdout, first.stdout[-3000:]
    assert '"steps"' not in second.stdout  # process 1 prints no summary (and writes no files)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    multi = [r for r in rows if "loss" in r]
    assert [r["step"] for r in multi] == [1, 2, 3]  # one writer: every step exactly once
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(
            [r[key] for r in multi], [r[key] for r in single], rtol=1e-5, err_msg=key
        )
    assert [r["num_documents"] for r in multi] == [r["num_documents"] for r in single]
    assert (out / "hf" / "model.safetensors").is_file() and (out / "config.json").is_file()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["3"]
