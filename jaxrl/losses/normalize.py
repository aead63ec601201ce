"""Ratio-of-sums normalisation: a loss is (numerator, denominator) summed over the whole step.

A loss function evaluates ONE micro-batch on ONE rank and returns the numerator (a sum over its
tokens, sequences or pairs) and its contribution to the step's denominator. The engine sums both
over micro-batches, psums them over the data axis and divides once, so the step objective

    L = Σ_{ranks, micro-batches} numerator / max(Σ_{ranks, micro-batches} denominator, 1)

does not depend on how documents were cut into micro-batches, packed or spread over ranks.
Never average per-micro-batch means (that is Fast-LLM's docs_per_step token bug, and TRL's bnpo).

This module is the only place where a loss type becomes a numerator and a denominator. Modes
(``ℓ_t`` per-token loss at target-aligned position t, ``m_t`` loss mask, ``N_d = Σ_{t∈d} m_t``,
N_seq documents; the GRPO column is ``loss_types.GRPO_LOSS_MODES``, the mode each
``GRPOConfig.loss_type`` uses):

=========  ==========================  ================================  ======================
mode       GRPO loss_type              numerator                         denominator
=========  ==========================  ================================  ======================
token      bnpo, dapo                  Σ_t m_t ℓ_t                       Σ_t m_t
sequence   grpo                        Σ_d Σ_{t∈d} m_t ℓ_t / max(N_d,1)  N_seq
document   seq_mean_token_sum          Σ_t m_t ℓ_t                       N_seq (Fast-LLM)
constant   dr_grpo                     Σ_t m_t ℓ_t                       N_seq × max_len
pair       (DPO, ``normalize=pair``)   Σ_p ℓ_p  (per-pair losses)        N_pairs
pair       (DPO, ``normalize=token``)  Σ_p T_p ℓ_p                       Σ_p T_p
=========  ==========================  ================================  ======================

N_seq counts every document present in the micro-batch, fully masked ones included: a document
with no loss token still counts (it adds 0 to the numerator). For DPO, T_p is the pair's chosen
plus rejected non-padding tokens, prompt included.

Every per-token sum goes through per-document segment sums and masks with ``jnp.where``, so
padding a row changes no bit of any result, and values at masked positions (even inf/NaN) never
reach the numerator or its gradient.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl.losses.loss_types import DPO_NORMALIZE

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


def num_documents(segment_ids_BT: jax.Array, parent_ids_BT: jax.Array | None = None) -> jax.Array:
    """Documents per row: segment ids are 1..n in row order, so the count is the max id; with
    ``parent_ids`` (shared-prompt packing, ``jaxrl.data.batching.shared_prompt``) less the
    prompt segments, the distinct non-zero parents of the row."""
    count = jnp.max(segment_ids_BT, axis=-1)
    if parent_ids_BT is None:
        return count
    p_BT = jnp.sort(parent_ids_BT.astype(jnp.int32), axis=-1)
    new_BT = (p_BT[:, 1:] != p_BT[:, :-1]) & (p_BT[:, 1:] > 0)
    parents = jnp.sum(new_BT, axis=-1) + (p_BT[:, 0] > 0)
    return count - parents.astype(count.dtype)


def gather_segments(x_BS: jax.Array, segment_ids_BT: jax.Array) -> jax.Array:
    """Broadcast per-document values back to tokens: ``out[b, t] = x[b, seg[b, t]]``."""
    return jnp.take_along_axis(x_BS, segment_ids_BT, axis=1)


def documents_present(
    segment_ids_BT: jax.Array, num_segments: int, parent_ids_BT: jax.Array | None = None
) -> jax.Array:
    """``[B, S]`` bool: slot s ≥ 1 holds a document in this row (slot 0 is always False).

    A document is present when it has at least one token, loss tokens or not. With ids 1..n in
    row order the count per row equals ``num_documents``. ``parent_ids`` (shared-prompt
    packing): a segment that is some token's parent is a shared prompt, not a document.
    """
    real_BT = (segment_ids_BT > 0).astype(jnp.float32)
    present_BS = segment_sum(real_BT, segment_ids_BT, num_segments) > 0
    if parent_ids_BT is not None:
        parent_BT = parent_ids_BT.astype(jnp.int32)
        is_parent_BS = segment_sum((parent_BT > 0).astype(jnp.float32), parent_BT, num_segments)
        present_BS = present_BS & ~(is_parent_BS > 0)
    return present_BS.at[:, 0].set(False)


def token_terms(
    loss_BT: jax.Array,
    mask_BT: jax.Array,
    segment_ids_BT: jax.Array,
    *,
    mode: str,
    num_segments: int,
    max_len: int | None = None,
    parent_ids_BT: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """(numerator, denominator) of a per-token loss for one micro-batch under ``mode``.

    ``mask_BT`` weighs each token (0 = no loss); padding (segment 0) never counts, nor does a
    shared prompt segment in N_seq (``parent_ids``, ``documents_present``). Masked
    positions are selected out with ``jnp.where``, so their values (even inf/NaN) reach neither
    the result nor its gradient. Sums run per document first (segment sums), then over documents.
    """
    if mode not in MODES or mode == "pair":
        raise ValueError(
            f"mode={mode!r}: per-token losses use one of token, sequence, document, "
            "constant ('pair' takes per-pair losses, see pair_terms)"
        )
    if mode == "constant" and max_len is None:
        raise ValueError("mode='constant' (Dr.GRPO) needs max_len")
    seg_BT = segment_ids_BT.astype(jnp.int32)
    w_BT = mask_BT.astype(jnp.float32)
    on_BT = (w_BT != 0) & (seg_BT > 0)
    loss_sum_BS = segment_sum(
        jnp.where(on_BT, loss_BT.astype(jnp.float32) * w_BT, 0.0), seg_BT, num_segments
    )[:, 1:]
    ntok_BS = segment_sum(jnp.where(on_BT, w_BT, 0.0), seg_BT, num_segments)[:, 1:]
    n_seq = jnp.sum(documents_present(seg_BT, num_segments, parent_ids_BT).astype(jnp.float32))
    if mode == "token":
        return jnp.sum(loss_sum_BS), jnp.sum(ntok_BS)
    if mode == "sequence":
        return jnp.sum(loss_sum_BS / jnp.maximum(ntok_BS, 1.0)), n_seq
    if mode == "document":
        return jnp.sum(loss_sum_BS), n_seq
    return jnp.sum(loss_sum_BS), n_seq * float(max_len)  # constant


def pair_terms(
    losses_BPr: jax.Array, valid_BPr: jax.Array, tokens_BPr: jax.Array, normalize: str
) -> tuple[jax.Array, jax.Array]:
    """(numerator, denominator) of per-pair losses (DPO): ``normalize='pair'`` → (Σ ℓ_p,
    N_pairs); ``'token'`` → (Σ T_p ℓ_p, Σ T_p). Invalid pair slots (``valid_BPr`` 0) are
    selected out, so their values never reach the result."""
    if normalize not in DPO_NORMALIZE:
        raise ValueError(f"normalize={normalize!r} is invalid: use one of {DPO_NORMALIZE}")
    on = valid_BPr > 0
    weight_BPr = jnp.where(on, 1.0 if normalize == "pair" else tokens_BPr.astype(jnp.float32), 0.0)
    return jnp.sum(jnp.where(on, losses_BPr, 0.0) * weight_BPr), jnp.sum(weight_BPr)


def finalize(numerator: jax.Array, denominator: jax.Array) -> jax.Array:
    """The step value: numerator over the denominator clamped at 1 (an empty step gives 0)."""
    return numerator / jnp.maximum(denominator, 1.0)
