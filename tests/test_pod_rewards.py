"""Rewards are computed once per completion (docs/rewards.md, "Several processes"): with two
processes, process 0 calls the reward functions and every process trains on its rewards, so a
function that returns its host's ``process_index`` (or random numbers) cannot make the hosts'
advantages differ; a function that raises on process 0 stops every process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pod_worker import run_workers

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_host_dependent_rewards_give_every_process_the_same_advantages(tmp_path):
    run_workers("rewards", tmp_path)
    first, second = (json.loads((tmp_path / f"rewards_{i}.json").read_text()) for i in range(2))
    assert first["calls"] == [8] and second["calls"] == []  # scored once, by process 0
    assert [row[0] for row in first["rewards"]] == pytest.approx([0.1 * i for i in range(8)])
    assert second["rewards"] == first["rewards"]  # bit for bit (JSON floats round-trip)
    assert second["advantages"] == first["advantages"]
    assert first["failed"].startswith("RewardFunctionError: reward function '<lambda>' raised")
    assert second["failed"].startswith("RuntimeError: process 0 failed")
