"""ORPO's odds-ratio term (Hong et al. 2024, arXiv:2403.07691; TRL ``experimental/orpo``).

With π̄_c, π̄_r the per-token mean log-probs of the chosen and rejected responses (so
``P = exp(π̄)`` is the geometric-mean token probability)::

    log_odds = (π̄_c − π̄_r) − (log(1 − e^{π̄_c}) − log(1 − e^{π̄_r}))
    ℓ_OR     = −β · log σ(log_odds)                       per pair

ORPO's step loss is ``NLL(chosen) + ℓ_OR`` with no reference model: the NLL is the mean over the
step's chosen response tokens and ℓ_OR the mean over its pairs, each a global Σ/Σ; the packed
micro-batch form (``jaxrl.losses.dpo.dpo_loss_terms`` with ``loss_type='orpo'``) folds both into
one numerator over the pair count with the constant ``nll_weight = N_pairs / N_chosen_tokens``
of the step (docs/losses.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

LOG_HALF = -0.6931471805599453


def log1mexp(x: jax.Array) -> jax.Array:
    """``log(1 − e^x)`` for x < 0, stably (Mächler 2012: ``log(−expm1 x)`` near 0, else
    ``log1p(−e^x)``), the branch at −ln 2 as TRL's. x = 0 gives −inf."""
    x = jnp.asarray(x, jnp.float32)
    near = x > LOG_HALF
    safe_near = jnp.where(near, x, LOG_HALF)  # each branch sees only its own inputs (gradients)
    safe_far = jnp.where(near, LOG_HALF, x)
    return jnp.where(near, jnp.log(-jnp.expm1(safe_near)), jnp.log1p(-jnp.exp(safe_far)))


def orpo_log_odds(mean_chosen: jax.Array, mean_rejected: jax.Array) -> jax.Array:
    """Per-pair log odds ratio of the chosen over the rejected response, from mean log-probs."""
    pc = jnp.asarray(mean_chosen, jnp.float32)
    pr = jnp.asarray(mean_rejected, jnp.float32)
    return (pc - pr) - (log1mexp(pc) - log1mexp(pr))


def odds_ratio_loss(
    mean_chosen: jax.Array, mean_rejected: jax.Array, *, beta: float = 0.1
) -> jax.Array:
    """Per-pair ``ℓ_OR = −β · log σ(log_odds)`` (the term ORPO adds to the chosen NLL)."""
    return -beta * jax.nn.log_sigmoid(orpo_log_odds(mean_chosen, mean_rejected))
