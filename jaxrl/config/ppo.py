"""``PPOConfig``: the ``ppo`` section of ``algorithm: ppo`` (docs/algorithms/ppo.md).

PPO is GRPO's rollouts and clipped actor objective with a critic: ``ppo.actor`` is a
``GRPOConfig`` (prompts, sampling, ``num_generations``, ``epsilon``, ``loss_type``, ``beta``,
``num_iterations``, rewards, the batch sizes), and the section's own fields are what only PPO has:
the critic, GAE and the KL in the reward. Names follow TRL's
``PPOConfig`` / tunix / verl: ``gamma``, ``gae_lambda`` (TRL ``lam``), ``clip_range_value``
(TRL ``cliprange_value``), ``vf_coef``, ``kl_in_reward``, ``kl_estimator``.
"""

from __future__ import annotations

import dataclasses

from jaxrl.config.base import require, require_choice
from jaxrl.config.grpo import GRPOConfig

KL_ESTIMATORS = ("k1", "k3")  # jaxrl.losses.ppo.KL_ESTIMATORS (numpy-free here)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PPOConfig:
    """The actor (GRPO's rollouts and clipped objective: ``ppo.actor``), the critic (value
    model), GAE and the KL penalty in the reward."""

    gamma: float = 1.0  # γ: discount per token (TRL default 1.0)
    gae_lambda: float = 0.95  # λ: GAE's bias/variance trade-off (TRL ``lam``)
    clip_range_value: float = 0.2  # ε_v: V may move at most ε_v from V_old before clipping
    vf_coef: float = 0.1  # c_v: the value loss's weight (TRL default 0.1)
    kl_in_reward: bool = True  # β·KL per token in the reward (TRL, verl use_kl_in_reward);
    # False: β·k3 in the actor's loss, as GRPO (β is grpo.beta in both cases)
    kl_estimator: str = "k1"  # the KL in the reward: k1 = log π_old − log π_ref, or k3
    whiten_advantages: bool = True  # whiten A over every loss token of the generation batch
    critic_learning_rate: float | None = None  # the critic's peak LR; None → optimizer's
    critic_path: str | None = None  # an HF directory for the critic's backbone (its value head
    # from value_head.npz there when present, else zeros); None → a copy of the policy at start
    actor: GRPOConfig = dataclasses.field(default_factory=lambda: GRPOConfig(world_size=None))
    # the rollouts and the actor's clipped objective, in grpo's keys (world size: the mesh's)

    def __post_init__(self) -> None:
        require(0.0 < self.gamma <= 1.0, "gamma", self.gamma, "use a discount in (0, 1]")
        require(0.0 <= self.gae_lambda <= 1.0, "gae_lambda", self.gae_lambda, "use λ in [0, 1]")
        require(
            self.clip_range_value > 0,
            "clip_range_value",
            self.clip_range_value,
            "use a positive clip width (TRL's default is 0.2)",
        )
        require(self.vf_coef > 0, "vf_coef", self.vf_coef, "use a positive weight")
        require_choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        require(
            self.critic_learning_rate is None or self.critic_learning_rate > 0,
            "critic_learning_rate",
            self.critic_learning_rate,
            "use a positive learning rate, or leave it unset to use the actor's",
        )
        self._check_actor()

    def _check_actor(self) -> None:
        """The actor's GRPO options that PPO's advantages and critic do not take."""
        a = self.actor
        require(
            not a.shared_prompt_packing,
            "actor.shared_prompt_packing",
            a.shared_prompt_packing,
            "the critic's forward and value loss read one document per completion; set it to false",
        )
        require(
            a.advantage_estimator == "grpo" and not a.kl_in_reward,
            "actor.advantage_estimator"
            if a.advantage_estimator != "grpo"
            else "actor.kl_in_reward",
            a.advantage_estimator if a.advantage_estimator != "grpo" else a.kl_in_reward,
            "PPO's advantages are GAE's: remove it (the KL in the reward is ppo.kl_in_reward)",
        )
