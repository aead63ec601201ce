"""Rewards are computed once per completion (docs/rewards.md, "Several processes"): with two
processes, process 0 calls the reward functions and every process trains on its rewards, so a
function that returns its host's ``process_index`` (or random numbers) cannot make the hosts'
advantages differ; a function that raises on process 0 stops every process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from gcs_emulator import free_port

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_host_dependent_rewards_give_every_process_the_same_advantages(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "tests/pod_worker.py", "rewards", str(i), "2", str(port), tmp_path],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    for p in procs:
        log = p.communicate(timeout=300)[0]
        assert p.returncode == 0, log[-3000:]
    first, second = (json.loads((tmp_path / f"rewards_{i}.json").read_text()) for i in range(2))
    assert first["calls"] == [8] and second["calls"] == []  # scored once, by process 0
    assert [row[0] for row in first["rewards"]] == pytest.approx([0.1 * i for i in range(8)])
    assert second["rewards"] == first["rewards"]  # bit for bit (JSON floats round-trip)
    assert second["advantages"] == first["advantages"]
    assert first["failed"].startswith("RewardFunctionError: reward function '<lambda>' raised")
    assert second["failed"].startswith("RuntimeError: process 0 failed")
