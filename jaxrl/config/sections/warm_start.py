"""``warm_start``: the SFT stage a GRPO, PPO, DPO or KTO run may start with.

The warm start trains the run's ``sft`` section on the built-in task for at most ``steps``
optimizer steps into ``<output_dir>/sft`` and starts the run's own stage from its export. It has
its own learning-rate schedule (an SFT warm start wants a far higher peak than an RL stage):
``learning_rate``, ``warmup_steps`` and ``decay`` here, each falling back to ``optimizer``'s (the
run's stage's) when unset; AdamW's other settings (``b1``, ``b2``, ``weight_decay``, clipping)
are ``optimizer``'s for both stages.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from jaxrl.config.base import require

__all__ = ["WARM_START_FIXES", "WarmStartConfig"]

# The top-level keys the warm_start section replaced: setting one is an error naming its new home
WARM_START_FIXES = {
    "sft_warmup_steps": (
        "moved: set warm_start.steps (the SFT warm start is the warm_start section)"
    ),
    "sft_warmup_target": (
        "moved: set warm_start.target (the SFT warm start is the warm_start section)"
    ),
    "sft_warmup_eval_every": (
        "moved: set warm_start.eval_every (the SFT warm start is the warm_start section)"
    ),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class WarmStartConfig:
    """An SFT warm start before the run's own stage (grpo, ppo, dpo, kto): the ``sft`` section's
    SFT on the built-in task into ``<output_dir>/sft``, then the stage starts from its export."""

    steps: int = 0  # SFT optimizer steps first (the warm start's schedule length); 0 = no warm
    # start (model.path or a fresh model)
    target: float = 0.0  # stop at the first check whose held-out greedy exact match reaches
    # this; steps is then the cap; 0 = run all steps
    eval_every: int = 10  # with a target: SFT steps between held-out checks
    learning_rate: float | None = None  # the warm start's peak learning rate; None =
    # optimizer.learning_rate (the run's stage's)
    warmup_steps: int | None = None  # the warm start's linear warmup; None = optimizer's
    decay: Literal["cosine", "linear", "constant"] | None = None  # the warm start's decay after
    # warmup; None = optimizer.decay

    def __post_init__(self):
        require(
            isinstance(self.steps, int) and self.steps >= 0,
            "warm_start.steps",
            self.steps,
            "use 0 (start from model.path or scratch) or a positive number of SFT steps",
        )
        require(
            0.0 <= self.target <= 1.0,
            "warm_start.target",
            self.target,
            "use a held-out exact-match accuracy in [0, 1] (0 = run all warm_start.steps)",
        )
        require(
            self.eval_every >= 1,
            "warm_start.eval_every",
            self.eval_every,
            "use a positive number of SFT steps between held-out checks",
        )
        if self.learning_rate is not None:
            require(
                self.learning_rate > 0,
                "warm_start.learning_rate",
                self.learning_rate,
                "use a positive learning rate, or leave it out for optimizer.learning_rate",
            )
        if self.warmup_steps is not None:
            require(
                self.warmup_steps >= 0,
                "warm_start.warmup_steps",
                self.warmup_steps,
                "use >= 0, or leave it out for optimizer.warmup_steps",
            )

    @property
    def enabled(self) -> bool:
        """Whether the run starts with SFT steps."""
        return self.steps > 0

    def optimizer_changes(self) -> dict[str, object]:
        """The ``optimizer`` fields the warm start sets for its own stage (the ones given)."""
        given = {
            "learning_rate": self.learning_rate,
            "warmup_steps": self.warmup_steps,
            "decay": self.decay,
        }
        return {k: v for k, v in given.items() if v is not None}
