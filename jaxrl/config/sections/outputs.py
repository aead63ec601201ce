"""``checkpoint``, ``export`` and ``logging``: what a run writes under ``output_dir``."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from typing import Literal

from jaxrl.config.base import ConfigError, require

__all__ = ["CheckpointConfig", "ExportConfig", "LoggingConfig"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Orbax checkpoints under ``<output_dir>/checkpoints``."""

    every: int = 0  # save every N steps; 0 = only at the end
    keep: int = 2  # keep the newest N checkpoints
    resume: bool = True  # continue from the newest checkpoint in output_dir if there is one

    def __post_init__(self):
        require(self.every >= 0, "checkpoint.every", self.every, "use 0 (end only) or N > 0")
        require(self.keep >= 1, "checkpoint.keep", self.keep, "keep at least one checkpoint")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExportConfig:
    """The HF export ``<output_dir>/hf`` written at the end of a run (docs/precision.md)."""

    dtype: Literal["float32", "bfloat16"] | None = None  # exported weights' dtype; None = the
    # model.path checkpoint's own (config.json torch_dtype), or model.param_dtype when fresh


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    """Console and file logging: metrics.jsonl, TensorBoard, W&B (docs/logging.md)."""

    progress: bool = True  # show a rich progress bar
    eval_every: int = 0  # evaluate every N steps; 0 = only at the end
    eval_samples: int = 8  # GRPO: samples per held-out prompt for eval/accuracy_sampled; 0 = off
    eval_rewards: bool = False  # GRPO / PPO: also score the held-out completions (greedy and
    # sampled) with the run's reward functions: eval/reward, eval/reward_sampled (the weighted
    # sum, as the training reward) and eval/rewards/<name>/mean[_sampled]; the held-out rows
    # then need no answer column (eval/accuracy needs one)
    tensorboard: bool = True  # mirror metrics.jsonl as event files in <output_dir>/tensorboard/
    wandb: str | None = None  # Weights & Biases project to log the same rows to; None = off

    def __post_init__(self):
        if self.wandb is not None:
            require(
                bool(self.wandb.strip()),
                "logging.wandb",
                self.wandb,
                "name a W&B project, or leave it out (None) to not use W&B",
            )
            if not _importable("wandb"):
                raise ConfigError(
                    f"logging.wandb={self.wandb!r} needs the wandb package: pip install wandb "
                    "(or leave logging.wandb out)"
                )
        require(self.eval_every >= 0, "logging.eval_every", self.eval_every, "use >= 0")
        require(
            isinstance(self.eval_rewards, bool),
            "logging.eval_rewards",
            self.eval_rewards,
            "use true (eval/reward from the run's reward functions too) or false",
        )
        require(
            self.eval_samples >= 0,
            "logging.eval_samples",
            self.eval_samples,
            "use 0 (greedy eval/accuracy only) or k > 0 samples per held-out prompt",
        )


def _importable(module: str) -> bool:
    """``import module`` would work (a module injected into ``sys.modules`` counts)."""
    if module in sys.modules:
        return sys.modules[module] is not None
    return importlib.util.find_spec(module) is not None
