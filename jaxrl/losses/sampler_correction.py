"""Importance weights for the gap between the sampler and the trainer (off-policy correction).

The sampler draws completions under its own numerics (compute dtype, sampling kernels) and, in
asynchronous runs, under weights some versions older than the ones the loss treats as "old".
The policy loss assumes the completions came from π_old; the weight

    w_t = π_old(y_t) / π_sampler(y_t) = exp(old_t − sampler_t)

corrects for the difference (TRL ``vllm_importance_sampling_*``; verl's TIS / MIS). ``old_t`` is
the trainer's log-prob under the weights that generated the batch (the scored old log-probs, or
the current ones when the step is on-policy), ``sampler_t`` the sampler's. The policy term of
token t is multiplied by ``w_t`` (the KL term is not), and the weight is not differentiated.

Modes (``grpo.importance_sampling_correction``; C = ``importance_sampling_cap``):

    token_truncate      w_t = min(ρ_t, C)                   ρ_t = exp(old_t − sampler_t)
    token_mask          w_t = ρ_t if 1/C ≤ ρ_t ≤ C else 0
    sequence_truncate   w_t = min(ρ_d, C)                   ρ_d = exp(Σ_{t∈d} m_t (old − sampler))
    sequence_mask       w_t = ρ_d if 1/C ≤ ρ_d ≤ C else 0
    sequence_geo_mask   w_t = 1 if 1/C ≤ g_d ≤ C else 0   g_d = exp(Σ_{t∈d} m_t(old − sampler)/N_d)

``*_mask`` drop a token or a whole document whose weight leaves [1/C, C] (TRL's masks drop only
above C); ``sequence_geo_mask`` keeps the unweighted loss of documents whose per-token geometric
mean ratio is within bounds (length-independent, for long completions). With identical sampler
and trainer numerics every ρ is exp(0) = 1 and every mode is the identity, bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.losses.loss_types import CORRECTION_MODES
from jaxrl.losses.normalize import gather_segments, segment_sum

Metrics = dict[str, tuple[jax.Array, jax.Array]]


def sampler_weights(
    old_logp_BT: jax.Array,
    sampler_logp_BT: jax.Array,
    mask_BT: jax.Array,
    segment_ids_BT: jax.Array,
    *,
    num_segments: int,
    mode: str,
    cap: float,
) -> tuple[jax.Array, Metrics]:
    """``(w_BT, metrics)``: the per-token importance weight of ``mode`` (module docstring),
    1 outside the loss tokens, with no gradient; metrics as (sum, count) pairs over loss tokens
    (token modes) or documents (sequence modes): ``sampler/is_ratio/mean`` (ρ before the cap)
    and ``sampler/is_clipped_frac`` (truncated or dropped)."""
    if mode not in CORRECTION_MODES:
        raise ValueError(
            f"importance_sampling_correction={mode!r} is invalid: use one of {CORRECTION_MODES}"
        )
    if not cap > 1.0:
        raise ValueError(f"importance_sampling_cap={cap!r} is invalid: use a value > 1")
    seg_BT = segment_ids_BT.astype(jnp.int32)
    m_BT = (mask_BT > 0) & (seg_BT > 0)
    diff_BT = jnp.where(
        m_BT,
        jax.lax.stop_gradient(old_logp_BT).astype(jnp.float32)
        - sampler_logp_BT.astype(jnp.float32),
        0.0,
    )
    if mode.startswith("token"):
        ratio, weight = jnp.exp(diff_BT), m_BT.astype(jnp.float32)
    else:
        sum_BS = segment_sum(diff_BT, seg_BT, num_segments)
        ntok_BS = segment_sum(m_BT.astype(jnp.float32), seg_BT, num_segments)
        if mode == "sequence_geo_mask":
            sum_BS = sum_BS / jnp.maximum(ntok_BS, 1.0)
        ratio = jnp.exp(sum_BS)
        weight = (ntok_BS > 0).at[:, 0].set(False).astype(jnp.float32)
    if mode.endswith("truncate"):
        w, clipped = jnp.minimum(ratio, cap), ratio > cap
    else:
        inside = (ratio >= 1.0 / cap) & (ratio <= cap)
        base = jnp.ones_like(ratio) if mode == "sequence_geo_mask" else ratio
        w, clipped = jnp.where(inside, base, 0.0), ~inside
    count = jnp.sum(weight)
    metrics = {
        "sampler/is_ratio/mean": (jnp.sum(jnp.where(weight > 0, ratio, 0.0)), count),
        "sampler/is_clipped_frac": (jnp.sum(clipped.astype(jnp.float32) * weight), count),
    }
    if not mode.startswith("token"):
        w = gather_segments(w, seg_BT)
    return jax.lax.stop_gradient(jnp.where(m_BT, w, 1.0)), metrics
