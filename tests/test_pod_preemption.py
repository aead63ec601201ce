"""A pod job on a GCS emulator, preempted (docs/tpu_pod.md, step 5): two CPU processes × 4
devices train grpo (scaled down) into ``gs://``; process 0 gets SIGTERM while step 2 is
generated; both processes stop after step 2 with the preemption code and line, step 2 is saved
in the bucket, and the same command resumes and finishes with the numbers of an uninterrupted
one-process run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gcs_emulator import BUCKET, emulator_env, free_port, gcs_emulator
from test_scale_out import JOBS

from jaxrl.cli import main
from jaxrl.runtime import storage
from jaxrl.train.run_io.metrics import read_metrics
from jaxrl.train.run_io.preemption import PREEMPTED_EXIT, preempted_line

ROOT = Path(__file__).resolve().parents[1]
REWARD = f"grpo.reward_funcs=['{ROOT / 'tests' / 'pod_worker.py'}:length_reward']"


def _sets() -> list[str]:
    _, sets = JOBS["grpo"]
    return [*sets, "max_steps=4", "grpo.per_device_train_batch_size=2", "logging.eval_every=0",
            "logging.progress=false", "checkpoint.every=0", REWARD]  # fmt: skip


def _launch(url: str, host: str, **extra_env: str) -> list[subprocess.CompletedProcess]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", STORAGE_EMULATOR_HOST=host, **extra_env)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    for k in ("TENSORSTORE_GCS_HTTP_URL", "GOOGLE_AUTH_TOKEN_FOR_TESTING"):
        env.pop(k, None)  # derived from STORAGE_EMULATOR_HOST by jaxrl, as for a user
    procs = []
    for pid in range(2):
        args = [sys.executable, "-m", "jaxrl.cli", "train", "configs/grpo_tiny.yaml"]
        for o in [*_sets(), f"output_dir={url}", "mesh.data=8",
                  f"distributed.coordinator_address=127.0.0.1:{port}",
                  "distributed.num_processes=2", f"distributed.process_id={pid}"]:  # fmt: skip
            args += ["--set", o]
        procs.append(
            subprocess.Popen(
                args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    done = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return done


@pytest.mark.slow
def test_two_process_gcs_run_preempted_on_one_process_resumes(tmp_path):
    args = ["train", "configs/grpo_tiny.yaml", "--set", f"output_dir={tmp_path / 'one'}"]
    for o in [*_sets(), "mesh.data=8"]:
        args += ["--set", o]
    assert main(args) == 0  # the uninterrupted reference: one process, 8 devices
    want = [r for r in read_metrics(tmp_path / "one" / "metrics.jsonl") if "loss" in r]
    url = f"gs://{BUCKET}/pod_run"
    with gcs_emulator() as host:
        preempted = _launch(url, host, JAXRL_TEST_SIGTERM_AT="2")
        for p in preempted:  # process 1 got no signal: it stops at the step process 0 does
            assert p.returncode == PREEMPTED_EXIT, p.stderr[-3000:]
            assert p.stderr.strip().splitlines()[-1] == preempted_line(2), p.stderr[-3000:]
        with emulator_env(host):
            run = storage.path(url)
            assert [p.name for p in (run / "checkpoints").iterdir()] == ["2"]
            resumed = _launch(url, host)
            for p in resumed:
                assert p.returncode == 0, p.stderr[-3000:]
            assert "resumed from step 2" in resumed[0].stderr
            got = [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in got] == [1, 2, 3, 4]  # each step once, none lost
    for key in ("loss", "grad_norm", "reward"):
        np.testing.assert_allclose(
            [r[key] for r in got], [r[key] for r in want], rtol=1e-5, err_msg=key
        )
