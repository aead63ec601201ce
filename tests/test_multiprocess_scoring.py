"""Two ``jax.distributed`` CPU processes (4 devices each) sample, score and build the reference
cache on one global 8-device mesh, and get what one process with 8 devices gets."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from multiprocess_worker import run

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.skipif(
    not hasattr(jax.config, "jax_cpu_collectives_implementation"),
    reason="this jax has no CPU collectives across processes",
)
def test_two_processes_get_what_one_process_gets(tmp_path):
    want = run(tmp_path / "single" / "cache")
    out = tmp_path / "multi"
    out.mkdir()
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    port = _free_port()
    worker = str(ROOT / "tests" / "multiprocess_worker.py")
    procs = [
        subprocess.Popen(
            [sys.executable, worker, str(i), "2", str(port), str(out)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-3000:]
    for i in range(2):
        with np.load(out / f"process_{i}.npz") as got:
            for name, value in want.items():
                np.testing.assert_array_equal(got[name], value, err_msg=f"process {i}: {name}")
    # one cache file, written by process 0 only, no temporary left
    assert sorted(os.listdir(out / "cache")) == list(want["files"])
