"""DPO and its variants on packed pairs.

Notation: π_c, π_r policy sequence log-probs of chosen and rejected, ref_c, ref_r the reference
values, β = ``beta``, ε = ``label_smoothing``, σ the logistic sigmoid, and the DPO margin
``z = (π_c − π_r) − (ref_c − ref_r)``.

    sigmoid / dpo (cDPO if ε > 0)   −(1−ε) logσ(βz) − ε logσ(−βz)          sums (Rafailov 2023)
    sigmoid_norm / dpo_norm         the same on per-token means               means
    ipo                             (z − 1/(2β))²                             means (Azar 2023)
    hinge                           relu(1 − βz)                              sums (SLiC)
    robust                          [−(1−ε) logσ(βz) + ε logσ(−βz)] / (1−2ε)  sums (rDPO)
    simpo                           sigmoid on z_s = (π̄_c − π̄_r) − γ̃, no ref means (Meng 2024)
    wpo                             sg(min(1, exp(ā_c + ā_r))) · ℓ_sigmoid    sums (Zhou 2024)
    orpo                            −β logσ(log_odds(π̄_c, π̄_r)) + NLL(chosen), no ref (Hong 2024)

Packing: a pair is two adjacent documents of one row, chosen = segment 2p−1 and rejected =
segment 2p (p = 1..Pr, Pr = (S−1)//2 pair slots per row). The step objective is a ratio of
global sums (``normalize.pair_terms``): ``pair`` → Σ_p ℓ_p / N_pairs; ``token`` → Σ_p T_p ℓ_p /
Σ_p T_p, with T_p the chosen plus rejected non-padding tokens, prompt included. Metrics are plain
means over pairs: reward accuracy, margin, chosen and rejected rewards and log-probs
(``dpo_metrics``). ORPO (``jaxrl.losses.orpo``) adds the chosen responses' NLL as its own global
token mean: each micro-batch adds ``nll_weight · Σ_chosen −logp`` to the pair numerator, with
``nll_weight = N_pairs / N_chosen_tokens`` of the whole step, a constant the trainer computes on
the host before the step; it also reports ``nll_loss``, ``log_odds_ratio``, ``log_odds_chosen``.

The loss-type names (``LOSS_TYPES``, ``MEAN_LOSS_TYPES``, ``SMOOTHING_LOSS_TYPES``) are defined
once, in ``jaxrl.losses.loss_types``; ``DPOConfig`` validates against the same lists.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.losses.loss_types import DPO_LOSS_TYPES as LOSS_TYPES
from jaxrl.losses.loss_types import DPO_MEAN_LOSS_TYPES as MEAN_LOSS_TYPES
from jaxrl.losses.loss_types import DPO_REFERENCE_FREE as REFERENCE_FREE
from jaxrl.losses.loss_types import DPO_SMOOTHING_LOSS_TYPES as SMOOTHING_LOSS_TYPES
from jaxrl.losses.normalize import LossTerms, documents_present, pair_terms, segment_sum
from jaxrl.losses.orpo import odds_ratio_loss, orpo_log_odds
from jaxrl.losses.policy import Metrics

IGNORE_INDEX = -100
MARGIN_TOLERANCE = 1e-5  # nats per loss token: |z| below this is fp32 noise (rewards/accuracy)


DPOLossTerms = LossTerms  # (numerator, denominator, metrics) of one micro-batch


def uses_mean_logps(loss_type: str) -> bool:
    """True when the loss takes per-token mean sequence log-probs, False for sums."""
    check_loss_type(loss_type)
    return loss_type in MEAN_LOSS_TYPES


def check_loss_type(loss_type: str, label_smoothing: float = 0.0) -> None:
    """ValueError for an unknown type, ε outside [0, 0.5), or ε ≠ 0 where it has no meaning."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r} is invalid: use one of {LOSS_TYPES}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing={label_smoothing!r} is invalid: use a value in [0, 0.5)")
    if label_smoothing != 0.0 and loss_type not in SMOOTHING_LOSS_TYPES:
        raise ValueError(
            f"label_smoothing={label_smoothing!r} is invalid with loss_type={loss_type!r}: set it "
            f"to 0 or use one of {SMOOTHING_LOSS_TYPES}"
        )


def _smoothed_sigmoid(x: jax.Array, eps: float) -> jax.Array:
    return -(1.0 - eps) * jax.nn.log_sigmoid(x) - eps * jax.nn.log_sigmoid(-x)


def wpo_weights(mean_chosen: jax.Array, mean_rejected: jax.Array) -> jax.Array:
    """WPO pair weights ``sg(min(1, exp(ā_c + ā_r)))`` from per-token mean policy log-probs."""
    w = jnp.minimum(1.0, jnp.exp(mean_chosen.astype(jnp.float32) + mean_rejected))
    return jax.lax.stop_gradient(w)


def dpo_loss(
    policy_chosen: jax.Array,
    policy_rejected: jax.Array,
    ref_chosen: jax.Array | None,
    ref_rejected: jax.Array | None,
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.3,
    weights: jax.Array | None = None,
) -> jax.Array:
    """Per-pair fp32 losses (module docstring). Inputs are sequence values, summed or averaged
    as ``uses_mean_logps(loss_type)`` says. ``simpo`` and ``orpo`` ignore the references (may
    be None); ``wpo`` needs ``weights`` (see ``wpo_weights``; treated as constants). For ``orpo``
    this is the odds-ratio term only; ``dpo_loss_terms`` adds the chosen NLL."""
    check_loss_type(loss_type, label_smoothing)
    eps = float(label_smoothing)
    pc = jnp.asarray(policy_chosen, jnp.float32)
    pr = jnp.asarray(policy_rejected, jnp.float32)
    if loss_type == "orpo":
        return odds_ratio_loss(pc, pr, beta=beta)
    if loss_type == "simpo":
        return _smoothed_sigmoid(beta * ((pc - pr) - simpo_gamma), eps)
    if ref_chosen is None or ref_rejected is None:
        raise ValueError(f"loss_type={loss_type!r} needs ref_chosen and ref_rejected")
    z = (pc - pr) - (jnp.asarray(ref_chosen, jnp.float32) - jnp.asarray(ref_rejected, jnp.float32))
    if loss_type in ("sigmoid", "dpo", "sigmoid_norm", "dpo_norm"):
        return _smoothed_sigmoid(beta * z, eps)
    if loss_type == "ipo":
        return (z - 1.0 / (2.0 * beta)) ** 2
    if loss_type == "hinge":
        return jax.nn.relu(1.0 - beta * z)
    if loss_type == "robust":
        logsig, logsig_neg = jax.nn.log_sigmoid(beta * z), jax.nn.log_sigmoid(-beta * z)
        return (-(1.0 - eps) * logsig + eps * logsig_neg) / (1.0 - 2.0 * eps)
    # wpo
    if weights is None:
        raise ValueError("loss_type='wpo' needs weights (wpo_weights of per-token mean log-probs)")
    w = jax.lax.stop_gradient(jnp.asarray(weights, jnp.float32))
    return w * _smoothed_sigmoid(beta * z, eps)


def dpo_rewards(
    policy_chosen: jax.Array,
    policy_rejected: jax.Array,
    ref_chosen: jax.Array | None,
    ref_rejected: jax.Array | None,
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
) -> tuple[jax.Array, jax.Array]:
    """Implicit rewards (no gradient): ``β(π − ref)`` per branch; ``β π̄`` for ``simpo`` and
    ``orpo`` (TRL's ORPO rewards)."""
    check_loss_type(loss_type)
    pc = jnp.asarray(policy_chosen, jnp.float32)
    pr = jnp.asarray(policy_rejected, jnp.float32)
    if loss_type not in REFERENCE_FREE:
        pc = pc - jnp.asarray(ref_chosen, jnp.float32)
        pr = pr - jnp.asarray(ref_rejected, jnp.float32)
    return jax.lax.stop_gradient(beta * pc), jax.lax.stop_gradient(beta * pr)


def dpo_metrics(
    policy_chosen: jax.Array,
    policy_rejected: jax.Array,
    ref_chosen: jax.Array | None,
    ref_rejected: jax.Array | None,
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    valid: jax.Array | None = None,
    tolerance: jax.Array | float = 0.0,
) -> Metrics:
    """Metrics as (sum, count) over the valid pairs; the step reports Σ sum / Σ count.

    ``rewards/accuracy`` counts a pair iff r_c − r_r > β·``tolerance`` (per pair, in the units
    of the sequence values; ties are wrong); ``rewards/margin`` is the mean of r_c − r_r.
    """
    r_c, r_r = dpo_rewards(
        policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta=beta, loss_type=loss_type
    )
    above_B = (r_c - r_r) > beta * jax.lax.stop_gradient(jnp.asarray(tolerance, jnp.float32))
    w = jnp.ones_like(r_c) if valid is None else valid.astype(jnp.float32)
    on = w > 0
    total = lambda x: jnp.sum(jnp.where(on, x, 0.0))
    count = jnp.sum(w)
    logp_c = jax.lax.stop_gradient(jnp.asarray(policy_chosen, jnp.float32))
    logp_r = jax.lax.stop_gradient(jnp.asarray(policy_rejected, jnp.float32))
    return {
        "rewards/chosen": (total(r_c), count),
        "rewards/rejected": (total(r_r), count),
        "rewards/accuracy": (total(above_B.astype(jnp.float32)), count),
        "rewards/margin": (total(r_c - r_r), count),
        "logps/chosen": (total(logp_c), count),
        "logps/rejected": (total(logp_r), count),
    }


def target_mask(
    labels_BT: jax.Array, segment_ids_BT: jax.Array, ignore_index: int = IGNORE_INDEX
) -> jax.Array:
    """Target-aligned loss mask: position t counts iff token t+1 is a label of the same document.

    ``labels`` hold ``ignore_index`` on prompt and padding tokens. The last position of a row or
    document never counts (it has no next token in its document).
    """
    nxt_label_BT = jnp.roll(labels_BT, -1, axis=1)
    nxt_seg_BT = jnp.roll(segment_ids_BT, -1, axis=1)
    not_last_BT = jnp.arange(labels_BT.shape[1])[None, :] < labels_BT.shape[1] - 1
    not_last_BT = jnp.broadcast_to(not_last_BT, labels_BT.shape)
    same_doc_BT = (nxt_seg_BT == segment_ids_BT) & (segment_ids_BT > 0)
    return (nxt_label_BT != ignore_index) & same_doc_BT & not_last_BT


def sequence_logps(
    token_logp: jax.Array,
    mask: jax.Array,
    segment_ids: jax.Array,
    num_segments: int,
    mean: bool,
) -> jax.Array:
    """Per-document sums (or means, count clamped ≥ 1) of masked target-aligned log-probs
    ``[B, T]`` → ``[B, S]``; slot 0 (padding) and fully masked documents give 0."""
    m_BT = (mask > 0) & (segment_ids > 0)
    lp_BT = jnp.where(m_BT, token_logp.astype(jnp.float32), 0.0)
    sum_BS = segment_sum(lp_BT, segment_ids, num_segments)
    if not mean:
        return sum_BS
    count_BS = segment_sum(m_BT.astype(jnp.float32), segment_ids, num_segments)
    return sum_BS / jnp.maximum(count_BS, 1.0)


def pair_documents(x_BS: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-document ``[B, S]`` → (chosen ``[B, Pr]``, rejected ``[B, Pr]``): slots 2p−1 and 2p."""
    num_pairs = (x_BS.shape[1] - 1) // 2
    return x_BS[:, 1 : 1 + 2 * num_pairs : 2], x_BS[:, 2 : 2 + 2 * num_pairs : 2]


def pair_mask(segment_ids_BT: jax.Array, num_segments: int) -> jax.Array:
    """``[B, Pr]`` bool: pair slot p holds both its chosen and its rejected document."""
    chosen_BPr, rejected_BPr = pair_documents(documents_present(segment_ids_BT, num_segments))
    return chosen_BPr & rejected_BPr


def pair_tokens(segment_ids_BT: jax.Array, num_segments: int) -> jax.Array:
    """``[B, Pr]`` T_p: non-padding tokens of the chosen plus rejected documents (prompt incl.)."""
    real_BT = (segment_ids_BT > 0).astype(jnp.float32)
    chosen_BPr, rejected_BPr = pair_documents(segment_sum(real_BT, segment_ids_BT, num_segments))
    return chosen_BPr + rejected_BPr


def dpo_loss_terms(
    token_logp_BT: jax.Array,
    loss_mask_BT: jax.Array,
    segment_ids_BT: jax.Array,
    ref_chosen_BPr: jax.Array | None,
    ref_rejected_BPr: jax.Array | None,
    *,
    num_segments: int,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.3,
    normalize: str = "pair",
    nll_weight: jax.Array | float | None = None,
) -> DPOLossTerms:
    """Numerator, denominator and metric sums of one packed micro-batch of pairs.

    ``token_logp_BT`` are target-aligned policy log-probs, ``loss_mask_BT`` the target mask
    (``target_mask``), ``ref_*_BP`` the reference sequence values (cache lookups) in the loss's
    aggregation, per pair slot; None for ``simpo`` and ``orpo``. Empty pair slots contribute
    nothing. ``nll_weight`` (``orpo`` only, required): the step's N_pairs / N_chosen_tokens.
    """
    check_loss_type(loss_type, label_smoothing)
    if (loss_type == "orpo") != (nll_weight is not None):
        raise ValueError("nll_weight is ORPO's (N_pairs / N_chosen_tokens): give it iff orpo")
    seg_BT = segment_ids_BT.astype(jnp.int32)
    valid_BPr = pair_mask(seg_BT, num_segments)
    means_BS = sequence_logps(token_logp_BT, loss_mask_BT, seg_BT, num_segments, mean=True)
    if uses_mean_logps(loss_type):
        values_BS = means_BS
    else:
        values_BS = sequence_logps(token_logp_BT, loss_mask_BT, seg_BT, num_segments, mean=False)
    pc_BPr, pr_BPr = pair_documents(values_BS)
    rc_BPr = rr_BPr = None
    if loss_type not in REFERENCE_FREE:
        if ref_chosen_BPr is None or ref_rejected_BPr is None:
            raise ValueError(f"loss_type={loss_type!r} needs ref_chosen_BPr and ref_rejected_BPr")
        rc_BPr = jnp.where(valid_BPr, ref_chosen_BPr.astype(jnp.float32), 0.0)
        rr_BPr = jnp.where(valid_BPr, ref_rejected_BPr.astype(jnp.float32), 0.0)
    weights_BPr = wpo_weights(*pair_documents(means_BS)) if loss_type == "wpo" else None
    losses_BPr = dpo_loss(
        pc_BPr,
        pr_BPr,
        rc_BPr,
        rr_BPr,
        beta=beta,
        loss_type=loss_type,
        label_smoothing=label_smoothing,
        simpo_gamma=simpo_gamma,
        weights=weights_BPr,
    )
    tokens_BPr = pair_tokens(seg_BT, num_segments)
    numerator, denominator = pair_terms(losses_BPr, valid_BPr, tokens_BPr, normalize)
    extra: Metrics = {}
    if loss_type == "orpo":
        sums_BS = sequence_logps(token_logp_BT, loss_mask_BT, seg_BT, num_segments, mean=False)
        m_BT = ((loss_mask_BT > 0) & (seg_BT > 0)).astype(jnp.float32)
        ntok_c_BPr, _ = pair_documents(segment_sum(m_BT, seg_BT, num_segments))
        nll = -jnp.sum(jnp.where(valid_BPr, pair_documents(sums_BS)[0], 0.0))
        numerator = numerator + jax.lax.stop_gradient(jnp.float32(nll_weight)) * nll
        log_odds_BPr = jax.lax.stop_gradient(orpo_log_odds(pc_BPr, pr_BPr))
        on = lambda x: jnp.sum(jnp.where(valid_BPr, x, 0.0))
        n_pairs = jnp.sum(valid_BPr.astype(jnp.float32))
        extra = {
            "nll_loss": (jax.lax.stop_gradient(nll), on(ntok_c_BPr)),
            "log_odds_ratio": (on(jax.nn.log_sigmoid(log_odds_BPr)), n_pairs),
            "log_odds_chosen": (on(log_odds_BPr), n_pairs),
        }
    metrics = dpo_metrics(
        pc_BPr,
        pr_BPr,
        rc_BPr,
        rr_BPr,
        beta=beta,
        loss_type=loss_type,
        valid=valid_BPr,
        tolerance=margin_tolerance(loss_mask_BT, seg_BT, num_segments, uses_mean_logps(loss_type)),
    )
    return DPOLossTerms(numerator, denominator, {**metrics, **extra})


def margin_tolerance(
    loss_mask_BT: jax.Array, segment_ids_BT: jax.Array, num_segments: int, mean: bool
) -> jax.Array:
    """``[B, Pr]`` the margin |z| under which ``rewards/accuracy`` counts a pair as a tie:
    ``MARGIN_TOLERANCE`` nats per loss token of the pair (chosen + rejected) for summed
    log-probs, ``2 · MARGIN_TOLERANCE`` for per-token means. The reference cache and the step's
    forward are two compiled programs whose fp32 sums may round apart (~1e-7), so at step 1
    (policy = reference) a strict ``z > 0`` would be a coin flip; docs/algorithms/dpo.md §5."""
    m_BT = ((loss_mask_BT > 0) & (segment_ids_BT > 0)).astype(jnp.float32)
    if mean:
        n_BS = documents_present(segment_ids_BT, num_segments).astype(jnp.float32)
    else:
        n_BS = segment_sum(m_BT, segment_ids_BT, num_segments)
    chosen_BPr, rejected_BPr = pair_documents(n_BS)
    return MARGIN_TOLERANCE * (chosen_BPr + rejected_BPr)
