"""Trainers: orchestration of data, the compiled step, metrics and checkpoints. Every trainer is
an ``Algorithm`` (``trainers.algorithm``: the contract and the loop that drives it), found by its
``algorithm:`` name in ``trainers.registry``."""

from __future__ import annotations

import time
from typing import Any

from jaxrl.config import RunConfig


def run(cfg: RunConfig) -> dict[str, Any]:
    """Run the trainer that ``cfg.algorithm`` names and return its summary: ``wall_s`` covers
    the whole command (an SFT warm start included) and ``stage_wall_s`` the trainer's own run.
    What the config cannot check without devices or user code (the world size of a ``-1`` mesh
    axis, GRPO's reward functions) is checked first, before a warm start
    (``Algorithm.for_run``)."""
    from jaxrl.trainers.registry import algorithm_class
    from jaxrl.trainers.warm_start import warm_start

    start = time.perf_counter()
    trainer = algorithm_class(cfg.algorithm).for_run(cfg, warm_start)
    summary = trainer.run()
    summary["stage_wall_s"] = summary.get("wall_s")
    summary["wall_s"] = round(time.perf_counter() - start, 1)
    return summary
