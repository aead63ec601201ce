"""PPO with a learned critic (``algorithm: ppo``; docs/algorithms/ppo.md).

GRPO's rollouts, schedule, scorer and clipped actor objective (the ``grpo`` section: a
``RolloutTrainer``) composed with a critic stage (``CriticStage``, the critic in
``trainers.ppo.critic``). Per generation, before its rows enter the
queue: the critic's values V_old (a no-grad pass), the token rewards (the scalar reward on the
last completion token, −β·KL per token with ``ppo.kl_in_reward``), GAE per document and the
advantages whitened over the whole generation batch, on the host (``losses.ppo``). Per step:
the actor's step on the token advantages, then the critic's step on the same packed batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxrl.config import ConfigError, RunConfig
from jaxrl.data.batching.step_plan import StepBatch
from jaxrl.losses.advantages import aggregate_rewards
from jaxrl.losses.ppo import explained_variance, kl_penalty, ppo_advantages
from jaxrl.rollout.generator import RolloutGenerator
from jaxrl.rollout.rewards.compute import RewardFunc
from jaxrl.rollout.rollout_queue import RolloutBatch
from jaxrl.train.objectives import Objective, grpo_objective
from jaxrl.trainers.grpo import RolloutTrainer, Stage
from jaxrl.trainers.ppo.critic import RETURN, VALUE_OLD, CriticRun
from jaxrl.trainers.session import Session

__all__ = ["CriticStage", "PPOTrainer", "check_ppo_settings"]


def check_ppo_settings(cfg: RunConfig) -> None:
    """What PPO does not combine with (yet), as ConfigErrors naming the field."""
    if cfg.model.lora.spec() is not None or cfg.model.lora.adapter_path is not None:
        raise ConfigError(
            "model.lora is set: PPO's critic is a full copy of the backbone and does not take "
            "LoRA adapters yet; remove model.lora (or use algorithm: grpo)"
        )
    if cfg.rollout.max_staleness:
        raise ConfigError(
            f"rollout.max_staleness={cfg.rollout.max_staleness} is invalid with algorithm: ppo: "
            "the critic's values are taken when a generation is trained on; use 0"
        )


def value_stats(
    returns: list[np.ndarray], values: list[np.ndarray], masks: list[np.ndarray], kl: Any
) -> dict[str, float]:
    """A generation's ``value/explained_variance``, ``returns/mean`` and, with the KL in the
    reward, ``kl_in_reward`` (the mean KL estimate over loss tokens)."""
    on = [np.asarray(m) > 0 for m in masks]
    out = {
        "value/explained_variance": explained_variance(returns, values, masks),
        "returns/mean": float(
            np.mean(np.concatenate([r[o] for r, o in zip(returns, on, strict=True)]))
        ),
    }
    if kl is not None:
        out["kl_in_reward"] = float(
            np.mean(np.concatenate([k[o] for k, o in zip(kl, on, strict=True)]))
        )
    return out


class CriticStage(Stage):
    """PPO's stage beside the actor: the critic's values and GAE advantages on each generation
    as it enters the queue, the critic's step after the actor's on the same packed batch, its
    checkpoints beside the policy's and its export at the end."""

    def __init__(self, cfg: RunConfig):
        self.ppo = cfg.ppo
        self.kl_in_reward = cfg.ppo.kl_in_reward and cfg.ppo.actor.beta > 0
        self.value_stats: dict[str, float] = {}

    def objective(self, cfg: RunConfig) -> Objective:
        """The GRPO family's clipped objective on the token advantages; with the KL in the
        reward the loss has no KL term."""
        config = cfg.ppo.actor
        if cfg.ppo.kl_in_reward:
            config = config.replace(beta=0.0)
        return grpo_objective(config, chunk_size=cfg.model.logprob_chunk)

    def old_logprobs(self, cfg: RunConfig) -> bool:  # the KL in the reward: π_old against π_ref
        return super().old_logprobs(cfg) or self.kl_in_reward

    def attach(self, cfg: RunConfig, session: Session, generator: RolloutGenerator) -> None:
        self.critic = CriticRun.build(cfg, session, cfg.schedule.max_tokens)
        session.programs.add("critic step", self.critic.step_fn)
        session.programs.add("critic values", self.critic.scorer)
        self.generator, self.beta = generator, cfg.ppo.actor.beta
        self.dtype = cfg.export.dtype or cfg.model.param_dtype  # of the critic's export

    def on_generation(self, batch: RolloutBatch) -> None:
        """V_old, token rewards, GAE and whitening of one generation batch (host, float64)."""
        p = self.ppo
        starts = [int(n) for n in batch.prompt_lengths]
        values = [v[n:] for v, n in zip(self.critic.values(batch.sequences), starts, strict=True)]
        masks = [m[n:] for m, n in zip(batch.loss_masks, starts, strict=True)]
        weights = self.generator.reward_columns(batch.rewards.shape[1])[0]
        kl = None
        if self.kl_in_reward:  # the generating policy against the reference, per token
            pairs = zip(batch.old_logp, batch.ref_logp, strict=True)
            kl = [kl_penalty(old, ref, p.kl_estimator) for old, ref in pairs]
        adv, ret = ppo_advantages(
            aggregate_rewards(batch.rewards, weights), values, masks, gamma=p.gamma,
            lam=p.gae_lambda, kl=kl, beta=self.beta, whiten_advantages=p.whiten_advantages,
        )  # fmt: skip
        batch.set_completion_field("token_advantage", adv)
        batch.set_completion_field(VALUE_OLD, values)
        batch.set_completion_field(RETURN, ret)
        batch.advantages = np.asarray([a[0] if len(a) else 0.0 for a in adv], np.float32)
        self.value_stats = value_stats(ret, values, masks, kl)

    def train_on(self, batch: StepBatch) -> dict[str, Any]:
        """The critic's step on the actor's packed batch: its metrics and the generation's."""
        critic = self.critic.train_on(batch.arrays, batch.rounds)
        row = {"critic/grad_norm": critic["grad_norm"]}
        row["critic/learning_rate"] = critic["learning_rate"]
        for name in ("value_loss", "value/mean", "value/clipfrac"):
            row[name] = critic[name]
        row.update(self.value_stats)
        return row

    def parameters(self) -> list[Any]:
        return [self.critic.state.params]

    def save(self, step: int) -> None:
        self.critic.save(step)

    def restore(self, step: int) -> None:
        self.critic.restore(step)

    def summary(self, summary: dict[str, Any]) -> dict[str, Any]:
        """The critic exported to ``<output_dir>/critic/hf``."""
        return {**summary, "critic_export": str(self.critic.export(self.dtype))}

    def close(self) -> None:
        self.critic.close()


class PPOTrainer(RolloutTrainer):
    """PPO: GRPO's rollouts with a critic stage (``CriticStage``); ``run()`` as GRPO's. The
    critic's metrics join each step's row: ``value_loss``, ``value/mean``, ``value/clipfrac``,
    ``value/explained_variance``, ``critic/grad_norm``."""

    description = "ppo"

    def __init__(self, cfg: RunConfig, *, reward_funcs: Sequence[str | RewardFunc] | None = None):
        check_ppo_settings(cfg)
        self.stage: CriticStage
        super().__init__(cfg, reward_funcs=reward_funcs, stage=CriticStage(cfg))

    @property
    def critic(self) -> CriticRun:
        """The critic (state, compiled step, value pass, checkpoints)."""
        return self.stage.critic

    @property
    def kl_in_reward(self) -> bool:
        return self.stage.kl_in_reward
