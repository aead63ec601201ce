"""Trainers: orchestration of data, the compiled step, metrics and checkpoints."""

from __future__ import annotations

from typing import Any

from jaxrl.config import RunConfig


def run(cfg: RunConfig) -> dict[str, Any]:
    """Run the trainer that ``cfg.algorithm`` names and return its summary."""
    if cfg.algorithm == "sft":
        from jaxrl.trainers.sft import SFTTrainer

        return SFTTrainer(cfg).run()
    if cfg.algorithm == "grpo":
        from jaxrl.trainers.grpo import GRPOTrainer
        from jaxrl.trainers.warm_start import warm_start

        return GRPOTrainer(warm_start(cfg)).run()
    if cfg.algorithm == "dpo":
        from jaxrl.trainers.dpo import DPOTrainer
        from jaxrl.trainers.warm_start import warm_start

        return DPOTrainer(warm_start(cfg)).run()
    raise NotImplementedError(f"algorithm={cfg.algorithm!r} has no trainer yet; 'sft' is available")
