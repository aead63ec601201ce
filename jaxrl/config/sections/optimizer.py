"""``optimizer``: AdamW and its learning-rate schedule, the one home of the run's learning rate."""

from __future__ import annotations

import dataclasses
from typing import Literal

from jaxrl.config.base import require

__all__ = ["OptimizerConfig"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """AdamW with warmup and decay, global-norm clipping; moments are always fp32."""

    learning_rate: float = 1e-3  # peak learning rate
    warmup_steps: int = 0  # linear warmup from 0 to the peak
    decay: Literal["cosine", "linear", "constant"] = "cosine"  # shape after warmup
    min_lr_ratio: float = 0.1  # final learning rate as a fraction of the peak
    weight_decay: float = 0.0  # decoupled weight decay
    b1: float = 0.9  # Adam first-moment decay
    b2: float = 0.95  # Adam second-moment decay. TRL's (transformers') default is 0.999;
    # 0.95 (Llama's, GPT-3's) averages over ~20 steps, not ~1000, so the step size follows the
    # gradient scale within runs of a few hundred steps (the shipped tiny configs, whose metrics
    # depend on it); the real-model configs set 0.999
    eps: float = 1e-8  # Adam epsilon
    max_grad_norm: float = 1.0  # global-norm clip; 0 = off
    max_nonfinite_steps: int = 3  # stop after this many non-finite steps in a row (skipped)
    master_rounding: Literal["stochastic", "nearest"] | None = None  # bf16 master only:
    # "stochastic" (unbiased, keeps updates in expectation) or "nearest" (updates under half a
    # bf16 ulp are lost; warned at start-up); an fp32 master needs none (docs/precision.md)

    def __post_init__(self):
        require(
            self.learning_rate > 0,
            "optimizer.learning_rate",
            self.learning_rate,
            "use a positive learning rate",
        )
        require(self.warmup_steps >= 0, "optimizer.warmup_steps", self.warmup_steps, "use >= 0")
        require(
            0 <= self.min_lr_ratio <= 1,
            "optimizer.min_lr_ratio",
            self.min_lr_ratio,
            "use a value in [0, 1]",
        )
        require(0 <= self.b1 < 1, "optimizer.b1", self.b1, "use a value in [0, 1)")
        require(0 <= self.b2 < 1, "optimizer.b2", self.b2, "use a value in [0, 1)")
        require(
            self.max_grad_norm >= 0,
            "optimizer.max_grad_norm",
            self.max_grad_norm,
            "use 0 to turn clipping off, or a positive norm",
        )
        require(self.weight_decay >= 0, "optimizer.weight_decay", self.weight_decay, "use >= 0")
        require(self.eps > 0, "optimizer.eps", self.eps, "use a small positive number, e.g. 1e-8")
        require(
            self.max_nonfinite_steps >= 1,
            "optimizer.max_nonfinite_steps",
            self.max_nonfinite_steps,
            "use >= 1 (a non-finite step is skipped; this many in a row stop the run)",
        )
