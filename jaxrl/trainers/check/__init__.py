"""One optimizer step of a config, as numbers to compare across layouts (``jaxrl check``).

:func:`one_step` builds the config's trainer on the devices in scope
(``jaxrl.runtime.mesh.use_devices``), takes its first step's batch exactly as ``jaxrl train``
would, runs one optimizer step and returns the step's loss, gradient norm and the updated
parameters on the host. Two layouts of the same config (mesh, micro-batch budget) start from
the same weights (the seed fixes them) and see the same global batch, so their outcomes must
agree to float rounding: :func:`compare` measures that (docs/algorithms/accumulation.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxrl.config import RunConfig
from jaxrl.runtime.mesh import to_host

__all__ = ["StepOutcome", "one_step", "compare", "max_relative_difference"]


@dataclasses.dataclass
class StepOutcome:
    """What one optimizer step produced: its metrics row and the updated parameters."""

    row: dict[str, Any]
    params: list[np.ndarray]  # leaves of the updated (trainable) parameters, tree order

    @property
    def loss(self) -> float:
        return float(self.row["loss"])

    @property
    def grad_norm(self) -> float:
        return float(self.row["grad_norm"])


def _trainer(cfg: RunConfig) -> Any:
    if cfg.algorithm == "dpo":
        from jaxrl.trainers.dpo import DPOTrainer

        trainer = DPOTrainer(cfg)
        trainer.build_references()
        return trainer
    if cfg.algorithm == "sft":
        from jaxrl.trainers.sft import SFTTrainer

        return SFTTrainer(cfg)
    raise NotImplementedError(f"algorithm={cfg.algorithm!r}")


def one_step(cfg: RunConfig) -> StepOutcome:
    """The first optimizer step of ``cfg`` (no SFT warm start: the caller resolves it)."""
    trainer = _trainer(cfg)
    session = trainer.session
    row = session.train_on(trainer.next_batch())
    params = [np.asarray(x, np.float64) for x in _leaves(to_host(session.state.params))]
    return StepOutcome(row, params)


def _leaves(tree: Any) -> list[Any]:
    import jax

    return jax.tree.leaves(tree)


def max_relative_difference(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    """max over leaves of max|a − b| / max|b| (a leaf of zeros compares absolutely)."""
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        scale = float(np.max(np.abs(y))) if y.size else 0.0
        diff = float(np.max(np.abs(x - y))) if y.size else 0.0
        worst = max(worst, diff / scale if scale > 0 else diff)
    return worst


def compare(a: StepOutcome, b: StepOutcome) -> dict[str, float]:
    """Relative differences of ``a`` from ``b``: loss, grad norm, updated parameters."""
    rel = lambda x, y: abs(x - y) / max(abs(y), 1e-30) if x != y else 0.0
    return {
        "loss": rel(a.loss, b.loss),
        "grad_norm": rel(a.grad_norm, b.grad_norm),
        "params": max_relative_difference(a.params, b.params),
    }
