"""Supervised cross-entropy as ratio-of-sums terms."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.losses.normalize import LossTerms, token_terms


def sft_terms(
    logp_BT: jax.Array,
    loss_mask_BT: jax.Array,
    segment_ids_BT: jax.Array,
    *,
    mode: str,
    num_segments: int,
) -> LossTerms:
    """Negative log-likelihood of the masked targets of one micro-batch.

    ``mode`` picks the step divisor (token / sequence / document, see ``normalize``). The
    ``nll`` metric is always the token mean, and ``accuracy``-free: exact match is measured by
    evaluation, not here.
    """
    nll_BT = -logp_BT.astype(jnp.float32)
    mask_BT = loss_mask_BT.astype(jnp.float32)
    num, den = token_terms(nll_BT, mask_BT, segment_ids_BT, mode=mode, num_segments=num_segments)
    return LossTerms(num, den, {"nll": (jnp.sum(nll_BT * mask_BT), jnp.sum(mask_BT))})
