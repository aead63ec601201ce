"""Ratio-of-sums normalisation: a loss is (numerator, denominator) summed over the whole step.

A loss function evaluates ONE micro-batch on ONE rank and returns the numerator (a sum over its
tokens, sequences or pairs) and its contribution to the step's denominator. The engine sums both
over micro-batches, psums them over the data axis and divides once, so the step objective

    L = Σ_{ranks, micro-batches} numerator / max(Σ_{ranks, micro-batches} denominator, 1)

does not depend on how documents were cut into micro-batches, packed or spread over ranks.
Never average per-micro-batch means (that is Fast-LLM's docs_per_step token bug, and TRL's bnpo).

Modes (``ℓ_t`` per-token loss at target-aligned position t, ``m_t`` loss mask, d documents):

=========  ================================  =====================================
mode       numerator                          denominator
=========  ================================  =====================================
token      Σ_t m_t ℓ_t                        Σ_t m_t
sequence   Σ_d Σ_{t∈d} m_t ℓ_t / max(N_d,1)   number of documents
document   Σ_t m_t ℓ_t                        number of documents (Fast-LLM docs_per_step)
constant   Σ_t m_t ℓ_t                        documents × max_len (Dr.GRPO)
pair       Σ_p ℓ_p  (per-pair losses)         number of pairs (DPO)
=========  ================================  =====================================
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

MODES = ("token", "sequence", "document", "constant", "pair")


class LossTerms(NamedTuple):
    """One micro-batch's share of the step objective and of its weighted metrics.

    ``metrics`` maps a name to a (sum, count) pair; the step reports Σ sum / Σ count.
    """

    numerator: jax.Array
    denominator: jax.Array
    metrics: dict[str, tuple[jax.Array, jax.Array]]


def segment_sum(x_BT: jax.Array, segment_ids_BT: jax.Array, num_segments: int) -> jax.Array:
    """Per-row sums over segments: ``out[b, s] = Σ_{t: seg[b,t]=s} x[b,t]`` → [B, S].

    ``segment_ids`` must lie in ``[0, num_segments)``; slot 0 collects padding. Out-of-range
    ids would be dropped silently by XLA, so callers size ``num_segments`` from the batch.
    O(B·T) work and memory whatever S is.
    """
    B = x_BT.shape[0]
    row_offsets_B1 = (jnp.arange(B, dtype=jnp.int32) * num_segments)[:, None]
    flat_ids = (segment_ids_BT.astype(jnp.int32) + row_offsets_B1).reshape(-1)
    sums = jax.ops.segment_sum(x_BT.reshape(-1), flat_ids, num_segments=B * num_segments)
    return sums.reshape(B, num_segments)


def num_documents(segment_ids_BT: jax.Array) -> jax.Array:
    """Documents per row: segment ids are 1..n in row order, so the count is the max id."""
    return jnp.max(segment_ids_BT, axis=-1)


def token_terms(
    loss_BT: jax.Array,
    mask_BT: jax.Array,
    segment_ids_BT: jax.Array,
    *,
    mode: str,
    num_segments: int,
    max_len: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """(numerator, denominator) of a per-token loss for one micro-batch under ``mode``."""
    mask_BT = mask_BT.astype(jnp.float32)
    weighted_BT = loss_BT.astype(jnp.float32) * mask_BT
    docs = jnp.sum(num_documents(segment_ids_BT)).astype(jnp.float32)
    if mode == "token":
        return jnp.sum(weighted_BT), jnp.sum(mask_BT)
    if mode == "document":
        return jnp.sum(weighted_BT), docs
    if mode == "constant":
        if max_len is None:
            raise ValueError("mode='constant' (Dr.GRPO) needs max_len")
        return jnp.sum(weighted_BT), docs * max_len
    if mode == "sequence":
        sums_BS = segment_sum(weighted_BT, segment_ids_BT, num_segments)[:, 1:]
        counts_BS = segment_sum(mask_BT, segment_ids_BT, num_segments)[:, 1:]
        return jnp.sum(sums_BS / jnp.maximum(counts_BS, 1.0)), docs
    raise ValueError(
        f"mode={mode!r}: per-token losses use one of token, sequence, document, "
        "constant ('pair' takes per-pair losses)"
    )


def finalize(numerator: jax.Array, denominator: jax.Array) -> jax.Array:
    """The step value: numerator over the denominator clamped at 1 (an empty step gives 0)."""
    return numerator / jnp.maximum(denominator, 1.0)
