"""AdamW with warmup + decay; fp32 moments whatever the parameter dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxrl.config.sections.optimizer import OptimizerConfig


def learning_rate_schedule(cfg: OptimizerConfig, max_steps: int) -> optax.Schedule:
    """Linear warmup to the peak, then cosine/linear decay to ``min_lr_ratio`` × peak."""
    peak, floor = cfg.learning_rate, cfg.learning_rate * cfg.min_lr_ratio
    decay_steps = max(max_steps - cfg.warmup_steps, 1)
    if cfg.decay == "cosine":
        decay = optax.cosine_decay_schedule(peak, decay_steps, alpha=cfg.min_lr_ratio)
    elif cfg.decay == "linear":
        decay = optax.linear_schedule(peak, floor, decay_steps)
    else:
        decay = optax.constant_schedule(peak)
    if cfg.warmup_steps == 0:
        return decay
    warmup = optax.linear_schedule(0.0, peak, cfg.warmup_steps)
    return optax.join_schedules([warmup, decay], [cfg.warmup_steps])


def _decay_mask(params):
    """Weight decay on matrices only (not norms, biases or scalars)."""
    return jax.tree.map(lambda p: jnp.ndim(p) >= 2, params)


def make_optimizer(cfg: OptimizerConfig, max_steps: int) -> optax.GradientTransformation:
    """AdamW on fp32 views of the parameters; clipping is applied by the train step."""
    return optax.adamw(
        learning_rate=learning_rate_schedule(cfg, max_steps),
        b1=cfg.b1,
        b2=cfg.b2,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        mask=_decay_mask,
        mu_dtype=jnp.float32,
    )
