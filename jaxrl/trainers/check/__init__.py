"""One optimizer step of a config, as numbers to compare across layouts (``jaxrl check``).

:func:`one_step` builds the config's trainer (``trainers.registry``) on the devices in scope
(``jaxrl.runtime.mesh.use_devices``), starts it and takes its first step exactly as ``jaxrl
train`` would (``Algorithm.start`` and ``train_step``: the trainer contract, nothing private),
and returns the step's loss, gradient norm and the updated parameters on the host. Two layouts
of the same config (mesh, micro-batch budget) start from the same weights (the seed fixes them)
and see the same global batch, so their outcomes must agree to float rounding: :func:`compare`
measures that (docs/algorithms/accumulation.md).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import numpy as np

from jaxrl.config import RunConfig
from jaxrl.runtime.mesh import to_host
from jaxrl.trainers.algorithm import Algorithm
from jaxrl.trainers.registry import build

__all__ = [
    "TOLERANCE",
    "StepOutcome",
    "compare",
    "layout_overrides",
    "max_relative_difference",
    "one_step",
    "outcome",
    "two_layouts",
    "verdict_lines",
]

# Relative tolerances of the verdict (docs/algorithms/accumulation.md, "jaxrl check"): fp32
# sums in another order differ by ~1e-7 relative; a layout-dependent objective by far more.
TOLERANCE = {"loss": 1e-5, "grad_norm": 1e-5, "params": 1e-5}
CRITIC = ("value_loss", "critic/grad_norm")  # PPO's critic step, compared as loss, grad_norm
# A GRPO-family loss is a sum of advantage-weighted terms that cancel to near 0 (advantages sum
# to 0 per group): its difference is measured relative to at least this (an absolute 1e-7).
LOSS_FLOOR = 1e-2
MIN_ADAM_EPS = 1e-3  # Adam's ε for the check's step (see layout_overrides)


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


def _start_trainer(cfg: RunConfig) -> Algorithm:
    """The config's trainer past its start (a fresh output_dir: nothing to resume), without the
    programs compiled ahead and the held-out evaluation a run measures first."""
    trainer = build(cfg)
    trainer.start(measure=False)
    return trainer


def outcome(trainer: Algorithm, row: dict[str, Any]) -> StepOutcome:
    """The row and the updated parameters (``Algorithm.parameters``: PPO's actor, then its
    critic)."""
    params = [leaf for tree in trainer.parameters() for leaf in _leaves(to_host(tree))]
    return StepOutcome(row, [np.asarray(x, np.float64) for x in params])


def one_step(cfg: RunConfig) -> StepOutcome:
    """The first optimizer step of ``cfg`` (no SFT warm start: the caller resolves it)."""
    trainer = _start_trainer(cfg)
    try:
        return outcome(trainer, trainer.train_step())
    finally:
        trainer.close()


def two_layouts(cfg_a: RunConfig, cfg_b: RunConfig) -> tuple[StepOutcome, StepOutcome]:
    """The first step of the same config in two layouts. What a step samples (GRPO: the first
    generation: its prompts, the policy's samples, the user's reward functions) is drawn by
    layout A and held by layout B (``Algorithm.draw`` / ``hold``; sampling itself is not part
    of the update), so both train on the same data; PPO: each layout's critic scores it."""
    first = _start_trainer(cfg_a)
    try:
        drawn = copy.deepcopy(first.draw())  # held by A for its step, kept for B
        a = outcome(first, first.train_step())
    finally:
        first.close()
    del first
    second = _start_trainer(cfg_b)
    try:
        if drawn is not None:
            second.hold(drawn)
        return a, outcome(second, second.train_step())
    finally:
        second.close()


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
    """Relative differences of ``a`` from ``b``: loss (relative to at least ``LOSS_FLOOR``),
    grad norm, updated parameters."""
    rel = lambda x, y, floor=1e-30: abs(x - y) / max(abs(y), floor) if x != y else 0.0
    out = {
        "loss": rel(a.loss, b.loss, LOSS_FLOOR),
        "grad_norm": rel(a.grad_norm, b.grad_norm),
        "params": max_relative_difference(a.params, b.params),
    }
    for name in CRITIC:  # PPO: the critic's step too (its parameters are in params)
        if name in a.row and name in b.row:
            out[name] = rel(float(a.row[name]), float(b.row[name]))
    return out


def layout_overrides(cfg: RunConfig, devices: int) -> tuple[list[str], list[str], str, str]:
    """``--set`` overrides of the two layouts and one line describing each.

    Both: no SFT warm start (the step starts from the config's model), no LR warmup (the step
    moves the parameters), Adam's ε at least ``MIN_ADAM_EPS`` (with ε = 1e-8, Adam's first step
    lr·g/(|g| + ε) turns the fp32 rounding of a gradient entry near 0 into up to ~1e-4 of a
    parameter; ε = 1e-3 keeps the update a smooth function of the gradient, so the parameters
    measure the gradient). Layout A is the config's mesh and micro-batch budget; layout B
    swaps the data and fsdp sizes (the same data-parallel ranks, so the same global batch,
    grouped otherwise) and halves ``schedule.max_tokens``.
    """
    from jaxrl.runtime.mesh import resolve_shape

    m = cfg.mesh
    data, fsdp, tensor = resolve_shape(m.data, m.fsdp, m.tensor, devices)
    common = [
        "optimizer.warmup_steps=0",
        f"optimizer.eps={max(cfg.optimizer.eps, MIN_ADAM_EPS)}",
    ]
    if cfg.warm_start is not None:
        common.insert(0, "warm_start.steps=0")
    tokens = cfg.schedule.max_tokens
    a = [*common, f"mesh.data={data}", f"mesh.fsdp={fsdp}", f"mesh.tensor={tensor}"]
    b = [
        *common,
        f"mesh.data={fsdp}",
        f"mesh.fsdp={data}",
        f"mesh.tensor={tensor}",
        f"schedule.max_tokens={max(tokens // 2, 1)}",
    ]
    line_a = f"mesh data={data} fsdp={fsdp} tensor={tensor}, schedule.max_tokens={tokens}"
    line_b = f"mesh data={fsdp} fsdp={data} tensor={tensor}, schedule.max_tokens={tokens // 2}"
    return a, b, line_a, line_b


def verdict_lines(a: StepOutcome, b: StepOutcome) -> tuple[list[str], list[str]]:
    """The report's lines (one per quantity) and the names of the quantities over tolerance."""
    diffs = compare(b, a)
    lines, failed = [], []
    critic = [(n, a.row[n], b.row[n]) for n in CRITIC if n in diffs]
    for name, value_a, value_b in (
        ("loss", a.loss, b.loss),
        ("grad_norm", a.grad_norm, b.grad_norm),
        *critic,
        ("params", None, None),
    ):
        tol, diff = TOLERANCE.get(name, TOLERANCE["loss"]), diffs[name]
        ok = diff <= tol
        failed += [] if ok else [name]
        values = (
            f"A {value_a:.9g}  B {value_b:.9g}  " if value_a is not None else "max over leaves  "
        )
        lines.append(
            f"{name:<10} {values}relative difference {diff:.2e} "
            f"{'<=' if ok else '>'} {tol:.0e}  {'ok' if ok else 'DIFFERENT'}"
        )
    return lines, failed
