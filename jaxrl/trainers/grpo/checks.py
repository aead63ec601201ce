"""What the GRPO family refuses before it builds anything: settings asynchronous generation and
shared-prompt packing do not combine with."""

from __future__ import annotations

from typing import Any

import jax

from jaxrl.config import ConfigError, GRPOConfig, RunConfig

__all__ = ["check_rollout_settings", "check_shared_prompt"]


def check_rollout_settings(cfg: RunConfig) -> None:
    """What asynchronous generation (``rollout.max_staleness``) does not do yet."""
    if cfg.rollout.max_staleness and jax.process_count() > 1:
        raise ConfigError(
            f"rollout.max_staleness={cfg.rollout.max_staleness} is single-process for now "
            f"and this run has {jax.process_count()} processes: use rollout.max_staleness=0"
        )
    if cfg.rollout.max_staleness and cfg.stage.uses_tools:
        raise ConfigError(
            f"rollout.max_staleness={cfg.rollout.max_staleness} does not run tool episodes "
            "yet (grpo.tools / grpo.environment): use rollout.max_staleness=0"
        )


def check_shared_prompt(config: GRPOConfig, model_config: Any) -> None:
    """Shared-prompt packing trains each prompt token once; a MoE load-balance loss counts
    every token it sees, so it would weigh prompts differently: refused."""
    balance = bool(model_config.moe_layers) and model_config.router_aux_loss_coef > 0
    if config.shared_prompt_packing and balance:
        raise ConfigError(
            "grpo.shared_prompt_packing=true is invalid with a MoE load-balance loss "
            f"(router_aux_loss_coef={model_config.router_aux_loss_coef}): it counts every "
            "trained token, and shared prompts are trained once instead of once per "
            "completion; set grpo.shared_prompt_packing=false (or the coefficient to 0)"
        )
