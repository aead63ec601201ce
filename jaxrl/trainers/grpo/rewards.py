"""A GRPO-family run's reward functions: given, named in ``grpo.reward_funcs``, or the built-in
task's defaults."""

from __future__ import annotations

from collections.abc import Sequence

from jaxrl.config import GRPOConfig
from jaxrl.rollout.rewards.compute import RewardFunc
from jaxrl.rollout.rewards.specs import resolve_reward_funcs

__all__ = ["DEFAULT_REWARD_FUNCS", "load_reward_funcs"]

DEFAULT_REWARD_FUNCS = ("exact_answer", "format")


def load_reward_funcs(
    config: GRPOConfig,
    given: Sequence[str | RewardFunc] | None = None,
    *,
    section: str = "grpo",
) -> list[RewardFunc]:
    """The run's reward functions, loaded and checked (``jaxrl.rollout.rewards.specs``; user
    modules run here): ``given`` (``GRPOTrainer``'s argument), else ``<section>.reward_funcs``
    (``section``: the config key of ``config``, ``ppo.actor`` for PPO), else the built-in task's
    ``DEFAULT_REWARD_FUNCS``."""
    length = config.max_completion_length
    if given:
        return resolve_reward_funcs(given, max_completion_length=length)
    specs = config.reward_funcs or DEFAULT_REWARD_FUNCS
    return resolve_reward_funcs(
        specs, field=f"{section}.reward_funcs", max_completion_length=length
    )
