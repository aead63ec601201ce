"""What an algorithm of the GRPO family adds to GRPO's rollouts: a :class:`Stage`, composed into
a ``RolloutTrainer`` (PPO = GRPO's rollouts + a critic stage, ``jaxrl.trainers.ppo``).

A stage names the objective the policy's step minimises and which log-probs its generations
need, and may train something beside the policy on the same packed batch. Every member is
declared here with GRPO's behaviour (the clipped objective, nothing beside the policy)."""

from __future__ import annotations

from typing import Any

from jaxrl.config import RunConfig
from jaxrl.data.batching.step_plan import StepBatch
from jaxrl.rollout.generator import RolloutGenerator
from jaxrl.rollout.rollout_queue import RolloutBatch
from jaxrl.train.objectives import Objective, grpo_objective
from jaxrl.trainers.grpo.planning import needs_old_logprobs
from jaxrl.trainers.session import Session

__all__ = ["Stage"]


class Stage:
    """GRPO's stage: the policy alone. Subclasses override what they add."""

    def objective(self, cfg: RunConfig) -> Objective:
        """What the policy's step minimises: the GRPO family's clipped objective."""
        return grpo_objective(cfg.stage, chunk_size=cfg.model.logprob_chunk)

    def old_logprobs(self, cfg: RunConfig) -> bool:
        """Whether a generation scores its policy's log-probs (``needs_old_logprobs``)."""
        return needs_old_logprobs(cfg)

    def attach(self, cfg: RunConfig, session: Session, generator: RolloutGenerator) -> None:
        """Build what the stage trains, once the run's session and generator exist."""

    def on_generation(self, batch: RolloutBatch) -> None:
        """A generation about to enter the row queue (made here or given to
        ``train_on_rollouts``): e.g. its advantages."""

    def train_on(self, batch: StepBatch) -> dict[str, Any]:
        """After the policy's step on ``batch``: the stage's own step; the metrics it adds."""
        return {}

    def parameters(self) -> list[Any]:
        """The parameter trees the stage trains."""
        return []

    def save(self, step: int) -> None:
        """Save the stage's state beside the policy's checkpoint ``step``."""

    def restore(self, step: int) -> None:
        """Restore the state saved beside checkpoint ``step``."""

    def summary(self, summary: dict[str, Any]) -> dict[str, Any]:
        """The run's summary, with what the stage exports at the end."""
        return summary

    def close(self) -> None:
        """Release what the stage holds."""
