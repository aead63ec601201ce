"""Trainers: orchestration of data, the compiled step, metrics and checkpoints."""

from __future__ import annotations

import time
from typing import Any

from jaxrl.config import RunConfig


def run(cfg: RunConfig) -> dict[str, Any]:
    """Run the trainer that ``cfg.algorithm`` names and return its summary. For GRPO and DPO,
    ``wall_s`` covers the whole command (an SFT warm start included) and ``stage_wall_s`` the
    RL stage alone."""
    if cfg.algorithm == "sft":
        from jaxrl.trainers.sft import SFTTrainer

        return SFTTrainer(cfg).run()
    if cfg.algorithm not in ("grpo", "dpo"):
        raise NotImplementedError(f"algorithm={cfg.algorithm!r} has no trainer")
    from jaxrl.trainers.warm_start import warm_start

    if cfg.algorithm == "grpo":
        from jaxrl.trainers.grpo import GRPOTrainer as Trainer
    else:
        from jaxrl.trainers.dpo import DPOTrainer as Trainer
    start = time.perf_counter()
    summary = Trainer(warm_start(cfg)).run()
    summary["stage_wall_s"] = summary.get("wall_s")
    summary["wall_s"] = round(time.perf_counter() - start, 1)
    return summary
