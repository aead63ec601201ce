"""Trainers: orchestration of data, the compiled step, metrics and checkpoints."""

from __future__ import annotations

import time
from typing import Any

from jaxrl.config import RunConfig


def run(cfg: RunConfig) -> dict[str, Any]:
    """Run the trainer that ``cfg.algorithm`` names and return its summary. For GRPO and DPO,
    ``wall_s`` covers the whole command (an SFT warm start included) and ``stage_wall_s`` the
    RL stage alone. What the config cannot check without devices or user code (the world size
    of a ``-1`` mesh axis, GRPO's reward functions) is checked first, before a warm start."""
    if cfg.algorithm == "sft":
        from jaxrl.trainers.sft import SFTTrainer

        return SFTTrainer(cfg).run()
    if cfg.algorithm not in ("grpo", "dpo", "kto", "ppo"):
        raise NotImplementedError(f"algorithm={cfg.algorithm!r} has no trainer")
    from jaxrl.trainers.dpo import DPOTrainer
    from jaxrl.trainers.grpo import GRPOTrainer, load_reward_funcs
    from jaxrl.trainers.kto import KTOTrainer
    from jaxrl.trainers.session import with_device_ranks
    from jaxrl.trainers.warm_start import warm_start

    cfg = with_device_ranks(cfg)
    funcs = load_reward_funcs(cfg.grpo) if cfg.algorithm in ("grpo", "ppo") else None
    start = time.perf_counter()
    stage_cfg = warm_start(cfg)
    if funcs and cfg.algorithm == "ppo":  # GRPO's rollouts and actor, plus a critic
        from jaxrl.trainers.ppo import PPOTrainer

        trainer = PPOTrainer(stage_cfg, reward_funcs=funcs)
    elif funcs:
        trainer = GRPOTrainer(stage_cfg, reward_funcs=funcs)
    else:
        trainer = KTOTrainer(stage_cfg) if cfg.algorithm == "kto" else DPOTrainer(stage_cfg)
    summary = trainer.run()
    summary["stage_wall_s"] = summary.get("wall_s")
    summary["wall_s"] = round(time.perf_counter() - start, 1)
    return summary
