"""The producer of a GRPO-family run's generations (``RolloutPipeline``'s produce): the next
prompts, sampled and scored, with DAPO's dynamic sampling."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxrl.config import ConfigError, RunConfig
from jaxrl.losses.advantages import informative_groups
from jaxrl.rollout.buffer import PromptSampler
from jaxrl.rollout.generator import RolloutGenerator, Sampled
from jaxrl.rollout.rewards.compute import TrainingProgress
from jaxrl.rollout.rollout_queue import RolloutBatch
from jaxrl.trainers.grpo.data import GRPOData

__all__ = ["Producer"]


class Producer:
    """``producer(params, step)``: the next generation batch, made with ``params`` (the weights
    after ``step`` updates), and its dynamic-sampling stats (``RolloutPipeline``'s produce).

    With ``grpo.dynamic_sampling`` (DAPO) the prompt groups whose rewards all agree (no
    learning signal: ``informative_groups``) are dropped and the next prompts are sampled
    until the batch holds ``generation_batch_size / num_generations`` groups (the first
    ones, in order; the rest are discarded, as DAPO does), at most
    ``max_dynamic_sampling_rounds`` generations; advantages are computed on the final batch.
    """

    def __init__(
        self, cfg: RunConfig, data: GRPOData, generator: RolloutGenerator, prompts: PromptSampler
    ):
        self.config, self.seed, self.max_steps = cfg.stage, cfg.seed, cfg.max_steps
        self.data, self.generator, self.prompt_sampler = data, generator, prompts

    def __call__(self, params: Any, step: int) -> tuple[RolloutBatch, dict[str, int]]:
        stats: dict[str, int] = {}
        if self.config.dynamic_sampling:
            sampled, stats = self._fill_with_signal(params, step)
        else:
            sampled = self._sample_next(params, step)
        batch = self.generator.build(params, *sampled)
        # the version of the weights that made it (rollout.sync_every may keep an older one)
        made_by = self.generator.sampler.weight_version
        batch.policy_version = step if made_by < 0 else min(step, made_by)
        return batch, stats

    def _sample_next(self, params: Any, step: int) -> Sampled:
        """The next generation's prompts, sampled and scored."""
        n = self.prompt_sampler.generations
        idx = self.prompt_sampler.next_generation()
        rows = [self.data.train_rows[i] for i in idx]
        return self.generator.sample(
            params,
            [self.data.train_prompts[i] for i in idx],
            [r["prompt"] for r in rows],
            {k: [r.get(k) for r in rows] for k in self.data.columns},
            jax.random.fold_in(jax.random.key(self.seed), n),
            TrainingProgress(global_step=step, max_steps=self.max_steps),
        )

    def _fill_with_signal(self, params: Any, step: int) -> tuple[Sampled, dict[str, int]]:
        """DAPO's dynamic sampling: keep drawing generations until enough groups have rewards
        that differ; returns the rows and the rounds and dropped groups (metrics)."""
        c, g = self.config, self.config.num_generations
        need = c.generation.size // g
        parts, kept, dropped = [], 0, 0
        for _ in range(c.max_dynamic_sampling_rounds):
            sampled = self._sample_next(params, step)
            keep_Q = informative_groups(sampled.rewards_BW, g, c.reward_weights)
            parts.append(sampled.rows(np.repeat(keep_Q, g)))
            kept, dropped = kept + int(keep_Q.sum()), dropped + int((~keep_Q).sum())
            if kept >= need:
                break
        else:
            raise ConfigError(
                f"grpo.dynamic_sampling=true: {c.max_dynamic_sampling_rounds} generations "
                f"(grpo.max_dynamic_sampling_rounds) found {kept} of the {need} prompt groups a "
                f"batch needs whose rewards differ ({dropped} groups had identical rewards): the "
                "prompts are too easy or too hard for the model, or the rewards do not vary; "
                "raise grpo.max_dynamic_sampling_rounds, check the reward functions, or set "
                "grpo.dynamic_sampling=false"
            )
        stats = {
            "dynamic_sampling/rounds": len(parts),  # one part per generation
            "dynamic_sampling/dropped_groups": dropped,
        }
        rows = Sampled.concat(parts)
        return rows.rows(np.arange(len(rows.truncated)) < need * g), stats  # first `need` groups
