"""GRPO-family policy loss on one packed micro-batch (TRL semantics): GRPO, GSPO, DAPO, Dr.GRPO,
CISPO.

Inputs are per-token arrays ``[B, T]`` of one packed micro-batch, target-aligned (the value at t
belongs to the prediction of token t+1). ``segment_ids`` are 1-based documents (one completion with
its prompt each), 0 = padding; per-document arrays are ``[B, S]`` with slot 0 for padding, and
``S = num_segments`` is static. ``m_t`` is the loss mask (completion tokens only), ``lp_t`` the
policy's log-prob of the target, ``old_t`` the log-prob under the policy that generated the
completion, ``ref_t`` the reference model's, ``A_d`` the advantage of document d, ``H_t`` the
token entropy and ``N_d = Σ_{t∈d} m_t``.

Per token::

    ρ_t = exp(lp_t − old_t)                                 (token level)
    ρ_t = exp(S_d),  S_d = Σ_{t∈d} m_t (lp_t − old_t) / max(N_d, 1)   (sequence level, GSPO)
    ρ̂ = clip(ρ, 1 − ε_low, 1 + ε_high);  ρ ← min(ρ, δ) if δ is set
    ℓ_t = −min(ρ A_d, ρ̂ A_d) · [H_t ≥ τ_H]  +  β k3_t,   k3_t = e^(ref−lp) − (ref−lp) − 1

CISPO (MiniMax-M1, arXiv:2506.13585; TRL ``loss_type="cispo"``) replaces the clipped surrogate by
a REINFORCE term weighted with the clipped importance weight, which is not differentiated, so
every token keeps a gradient (none is clipped to zero)::

    ℓ_t = −sg(min(ρ_t, ε_high)) · A_d · lp_t · [H_t ≥ τ_H]  +  β k3_t

with ``ε_high`` the cap on the weight itself (ScaleRL recommends 5), not a clip width; the
clip metrics count ρ > ε_high with A > 0 as ``clip_ratio/high_mean``.

The ratio, the clipped surrogate and the KL term form ℓ_t; the entropy gate ``[H_t ≥ τ_H]``
(τ_H the step-wide quantile, only when ``entropy_threshold`` is given) keeps the policy term of
high-entropy tokens only. ``loss_type`` then picks how ℓ_t becomes this micro-batch's numerator
and denominator contribution: it names a mode of ``jaxrl.losses.normalize`` (the engine sums
both over micro-batches and ranks and divides once, ``finalize``):

    grpo                sequence   Σ_d Σ_{t∈d} m ℓ / max(N_d, 1)   /  N_seq
    bnpo, dapo          token      Σ m ℓ                            /  Σ m
    dr_grpo             constant   Σ m ℓ                            /  N_seq · max_completion_length
    seq_mean_token_sum  document   Σ m ℓ                            /  N_seq   (Fast-LLM GSPO, #544)
    cispo               token      Σ m ℓ                            /  Σ m

N_seq counts every document present in the micro-batch, fully masked ones included. Every sum
goes through per-document segment sums, so padding a row changes no bit of any result, and values
at masked positions (even inf/NaN) never reach the loss or its gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.losses.loss_types import GRPO_LOSS_MODES, GRPO_LOSS_TYPES, IMPORTANCE_SAMPLING_LEVELS
from jaxrl.losses.normalize import (
    LossTerms,
    documents_present,
    gather_segments,
    segment_sum,
    token_terms,
)

Metrics = dict[str, tuple[jax.Array, jax.Array]]


PolicyLossTerms = LossTerms  # (numerator, denominator, metrics) of one micro-batch


def k3_kl(ref_logp: jax.Array, logp: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """Schulman's k3 estimator of KL(π‖π_ref): ``exp(ref − lp) − (ref − lp) − 1`` (≥ 0).

    Where ``mask`` is False the difference is set to 0 before the exponential, so the value
    there is 0 and whatever ``ref``/``lp`` hold (even inf/NaN) reaches no gradient.
    """
    d = ref_logp - logp
    if mask is not None:
        d = jnp.where(mask, d, 0.0)
    return jnp.exp(d) - d - 1.0


def entropy_threshold(
    entropy: jax.Array, mask: jax.Array, top_entropy_quantile: float
) -> jax.Array:
    """τ_H: the (1 − q) quantile, linear interpolation, of the entropies where ``mask`` holds.

    Works on any shape (flattened): over a whole step the trainer feeds every valid token of the
    step (all micro-batches, all ranks) from a no-grad pre-pass. No valid token → +inf.
    """
    h_flat = jnp.reshape(entropy, (-1,)).astype(jnp.float32)
    valid_flat = jnp.reshape(mask, (-1,)) > 0
    n = jnp.sum(valid_flat.astype(jnp.int32))
    sorted_flat = jnp.sort(jnp.where(valid_flat, h_flat, jnp.inf))
    last = jnp.maximum(n - 1, 0)
    pos = jnp.float32(1.0 - top_entropy_quantile) * last.astype(jnp.float32)
    i0 = jnp.clip(jnp.floor(pos).astype(jnp.int32), 0, last)
    i1 = jnp.minimum(i0 + 1, last)
    frac = pos - i0.astype(jnp.float32)
    v0, v1 = sorted_flat[i0], sorted_flat[i1]
    tau = v0 + frac * (v1 - v0)
    return jax.lax.stop_gradient(jnp.where(n > 0, tau, jnp.inf))


def entropy_mask(entropy_BT: jax.Array, mask_BT: jax.Array, threshold: jax.Array) -> jax.Array:
    """Keep valid tokens whose entropy is ≥ the threshold (bool, same shape)."""
    return (mask_BT > 0) & (entropy_BT >= threshold)


def clipped_surrogate(
    ratio: jax.Array,
    adv: jax.Array,
    *,
    epsilon_low: float,
    epsilon_high: float,
    delta: float | None = None,
) -> jax.Array:
    """PPO objective ``min(min(ρ, δ)·A, clip(ρ, 1−ε_low, 1+ε_high)·A)`` (to maximise).

    Value as TRL. The gradient is ``A·∂ρ`` exactly where the selected term depends on ρ, built
    from explicit masks with inclusive boundaries (as Fast-LLM): for A > 0 it flows iff
    ρ ≤ 1+ε_high (and ρ ≤ δ), for A < 0 iff ρ ≥ 1−ε_low (and ρ ≤ δ). Autodiff of min/clip
    would split ties 0.5/0.5 at the boundaries instead.
    """
    lo, hi = 1.0 - epsilon_low, 1.0 + epsilon_high
    r = jax.lax.stop_gradient(ratio)
    a = jax.lax.stop_gradient(adv)
    capped = r if delta is None else jnp.minimum(r, delta)
    unclipped_term, clipped_term = capped * a, jnp.clip(r, lo, hi) * a
    unclipped_live = jnp.ones_like(r, dtype=bool) if delta is None else r <= delta
    clipped_live = (r >= lo) & (r <= hi)
    live = jnp.where(
        unclipped_term < clipped_term,
        unclipped_live,
        jnp.where(clipped_term < unclipped_term, clipped_live, unclipped_live | clipped_live),
    )
    # Where live, ratio * a equals the selected term bit for bit (min(ρ,δ) = ρ or clip(ρ) = ρ).
    return jnp.where(live, ratio * a, jnp.minimum(unclipped_term, clipped_term))


def _clip_counts(
    ratio: jax.Array,
    adv: jax.Array,
    weight: jax.Array,
    lo: float,
    hi: float,
    delta: float | None,
    segment_ids_BT: jax.Array | None,
    num_segments: int,
) -> Metrics:
    """TRL clip fractions as (sum, count): low = ρ<1−ε_low ∧ A<0, high = ρ>1+ε_high ∧ A>0."""
    r = jax.lax.stop_gradient(ratio if delta is None else jnp.minimum(ratio, delta))
    low = ((r < lo) & (adv < 0)).astype(jnp.float32) * weight
    high = ((r > hi) & (adv > 0)).astype(jnp.float32) * weight
    region = jnp.maximum(low, high)
    if segment_ids_BT is not None:  # token level: reduce through per-document sums
        low, high, region, weight = (
            segment_sum(x, segment_ids_BT, num_segments) for x in (low, high, region, weight)
        )
    count = jnp.sum(weight[:, 1:])
    return {
        "clip_ratio/low_mean": (jnp.sum(low[:, 1:]), count),
        "clip_ratio/high_mean": (jnp.sum(high[:, 1:]), count),
        "clip_ratio/region_mean": (jnp.sum(region[:, 1:]), count),
    }


def policy_loss_terms(
    logp_BT: jax.Array,
    old_logp_BT: jax.Array | None,
    ref_logp_BT: jax.Array | None,
    adv_BS: jax.Array,
    loss_mask_BT: jax.Array,
    segment_ids_BT: jax.Array,
    entropy_BT: jax.Array | None = None,
    *,
    loss_type: str = "dapo",
    importance_sampling_level: str = "token",
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    beta: float = 0.0,
    max_completion_length: int = 512,
    entropy_threshold: jax.Array | None = None,
    is_weight_BT: jax.Array | None = None,
    token_adv_BT: jax.Array | None = None,
    kl_bias_correction: bool = False,
    parent_ids_BT: jax.Array | None = None,
) -> PolicyLossTerms:
    """Numerator, denominator and metric sums of one packed micro-batch (module docstring).

    ``old_logp_BT=None`` means on-policy: old = stop_gradient(logp), ρ ≡ 1 with ∂ρ = ∂lp.
    ``ref_logp_BT`` is required iff ``beta != 0``. ``entropy_threshold`` (from
    ``entropy_threshold(...)`` over the whole step) enables the entropy mask; ``entropy_BT``
    feeds it and the ``entropy`` metric. Metrics: ``clip_ratio/{low,high,region}_mean`` (over
    loss tokens at token level, over documents at sequence level), ``entropy`` and, when
    β ≠ 0, ``kl`` (over loss tokens). ``is_weight_BT`` (``sampler_correction.sampler_weights``)
    multiplies each token's policy term, not its KL term (TRL's order). ``token_adv_BT``:
    per-token advantages (REINFORCE++ with the KL in the reward,
    ``advantages.kl_in_reward_advantages``) used in the policy term instead of ``A_d``; the
    sequence-level clip metrics still read the sign of ``A_d``. ``kl_bias_correction``
    (TRL's ``use_bias_correction_kl``) multiplies each token's k3 by the differentiable ratio
    ρ_t (token level) or ρ_d (sequence level): ``β ρ k3``; on-policy ρ = 1 in value but its
    gradient ∂lp adds ``β k3 ∂lp``. The ``kl`` metric is then the mean of ρ·k3, as TRL logs it.
    ``parent_ids_BT`` (shared-prompt packing): a parent segment is a shared prompt, not a
    document (``normalize.documents_present``); it has no loss token, so it adds nothing.
    """
    if loss_type not in GRPO_LOSS_MODES:
        raise ValueError(f"loss_type={loss_type!r} is invalid: use one of {GRPO_LOSS_TYPES}")
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(
            f"importance_sampling_level={importance_sampling_level!r} is invalid: "
            f"use one of {IMPORTANCE_SAMPLING_LEVELS}"
        )
    if beta != 0.0 and ref_logp_BT is None:
        raise ValueError(f"beta={beta} needs ref_logp_BT (reference log-probs)")
    if entropy_threshold is not None and entropy_BT is None:
        raise ValueError("entropy_threshold needs entropy_BT")
    num_segments = adv_BS.shape[1]
    seg_BT = segment_ids_BT.astype(jnp.int32)
    m_BT = (loss_mask_BT > 0) & (seg_BT > 0)
    mf_BT = m_BT.astype(jnp.float32)
    eps_low, eps_high = epsilon, (epsilon if epsilon_high is None else epsilon_high)
    cispo = loss_type == "cispo"
    if cispo and (epsilon_high is None or delta is not None):
        raise ValueError(
            "loss_type='cispo' caps the importance weight at epsilon_high (set it, e.g. 5.0) "
            "and takes no delta"
        )
    lo, hi = (0.0, eps_high) if cispo else (1.0 - eps_low, 1.0 + eps_high)
    segsum = lambda x_BT: segment_sum(x_BT, seg_BT, num_segments)

    logp_BT = logp_BT.astype(jnp.float32)
    old_BT = jax.lax.stop_gradient(logp_BT if old_logp_BT is None else old_logp_BT)
    log_ratio_BT = jnp.where(m_BT, logp_BT - old_BT.astype(jnp.float32), 0.0)
    adv_BS = jax.lax.stop_gradient(adv_BS.astype(jnp.float32))
    if token_adv_BT is None:
        adv_BT = jnp.where(m_BT, gather_segments(adv_BS, seg_BT), 0.0)
    else:
        adv_BT = jnp.where(m_BT, jax.lax.stop_gradient(token_adv_BT.astype(jnp.float32)), 0.0)
    present_BS = documents_present(seg_BT, num_segments, parent_ids_BT)
    ntok_BS = segsum(mf_BT)

    if importance_sampling_level == "token":
        ratio_BT = jnp.exp(log_ratio_BT)
        metrics = _clip_counts(ratio_BT, adv_BT, mf_BT, lo, hi, delta, seg_BT, num_segments)
    else:
        seq_log_ratio_BS = segsum(log_ratio_BT) / jnp.maximum(ntok_BS, 1.0)
        ratio_BS = jnp.exp(seq_log_ratio_BS)
        ratio_BT = jnp.where(m_BT, gather_segments(ratio_BS, seg_BT), 1.0)
        metrics = _clip_counts(
            ratio_BS, adv_BS, present_BS.astype(jnp.float32), lo, hi, delta, None, num_segments
        )

    if cispo:
        weight_BT = jax.lax.stop_gradient(jnp.minimum(ratio_BT, eps_high))
        objective_BT = weight_BT * adv_BT * jnp.where(m_BT, logp_BT, 0.0)
    else:
        objective_BT = clipped_surrogate(
            ratio_BT, adv_BT, epsilon_low=eps_low, epsilon_high=eps_high, delta=delta
        )
    loss_BT = -objective_BT
    if entropy_threshold is not None:
        keep_BT = entropy_mask(entropy_BT, m_BT, entropy_threshold)
        loss_BT = loss_BT * keep_BT.astype(jnp.float32)
    if is_weight_BT is not None:
        loss_BT = loss_BT * jax.lax.stop_gradient(is_weight_BT)
    if beta != 0.0:
        kl_BT = k3_kl(jax.lax.stop_gradient(ref_logp_BT), logp_BT, m_BT)
        if kl_bias_correction:
            kl_BT = kl_BT * ratio_BT
        loss_BT = loss_BT + beta * kl_BT
        metrics["kl"] = (jnp.sum(segsum(kl_BT * mf_BT)[:, 1:]), jnp.sum(ntok_BS[:, 1:]))
    if entropy_BT is not None:
        h_BT = jnp.where(m_BT, jax.lax.stop_gradient(entropy_BT).astype(jnp.float32), 0.0)
        metrics["entropy"] = (jnp.sum(segsum(h_BT)[:, 1:]), jnp.sum(ntok_BS[:, 1:]))

    numerator, denominator = token_terms(
        loss_BT,
        m_BT,
        seg_BT,
        mode=GRPO_LOSS_MODES[loss_type],
        num_segments=num_segments,
        max_len=max_completion_length,
        parent_ids_BT=parent_ids_BT,
    )
    return PolicyLossTerms(numerator, denominator, metrics)
