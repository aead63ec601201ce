"""KTO on unpaired examples (Ethayarajh et al. 2024, arXiv:2402.01306; TRL ``KTOTrainer``).

Example i is a prompt x_i, a completion y_i and a label (desirable or undesirable). With π and
ref the policy's and the reference's summed completion log-probs:

    r_i = π(y_i | x_i) − ref(y_i | x_i)
    z₀  = max(0, Σ_j [π(y'_j | x_j) − ref(y'_j | x_j)] / N_kl)        (no gradient)

    kto                desirable   w_d (1 − σ(β (r − z₀)))     undesirable  w_u (1 − σ(β (z₀ − r)))
    apo_zero_unpaired  desirable   w_d (1 − σ(β r))            undesirable  w_u σ(β r)

and the step loss is ``Σ_i ℓ_i / N_examples`` over the whole step (TRL: the mean over each
micro-batch's examples on each device). The KL pairs (x_j, y'_j) are mismatched: every prompt
of the step with the completion of another example of the step. TRL pairs within each device's
micro-batch (completion j−1 for prompt j) and averages z₀ per device, so its reference point
and update depend on the device count and the batch split, and it needs a per-device batch
> 1. jaxrl builds the pairs on the host over the GLOBAL batch with a seeded derangement
(:func:`mismatched_completions`) and computes z₀ once per step as one global Σ/Σ
(:func:`reference_point`, from a no-grad pre-pass) that enters the step as a constant.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.losses.loss_types import KTO_LOSS_TYPES
from jaxrl.losses.normalize import LossTerms, documents_present, segment_sum


def mismatched_completions(n: int, rng: np.random.Generator) -> np.ndarray:
    """``[n]`` int64: the example whose completion pairs with prompt j for the KL estimate, a
    seeded derangement of the step's examples (one random cycle: never j itself for n ≥ 2)."""
    if n < 2:
        raise ValueError(f"KTO's KL pairs need at least 2 examples in a step, got {n}")
    order = rng.permutation(n)
    partner = np.empty(n, np.int64)
    partner[order] = np.roll(order, -1)
    return partner


def reference_point(kl_policy: np.ndarray, kl_reference: np.ndarray) -> float:
    """z₀ = max(0, Σ_j (π_j − ref_j) / N) over every KL pair of the step, summed on the host in
    float64 in example order (so every layout gets the same bits from the same values)."""
    diff = np.asarray(kl_policy, np.float64) - np.asarray(kl_reference, np.float64)
    if diff.size == 0:
        return 0.0
    return max(0.0, float(np.sum(diff) / diff.size))


def kto_loss(
    policy: jax.Array,
    reference: jax.Array,
    desirable: jax.Array,
    *,
    z0: jax.Array | float,
    beta: float = 0.1,
    loss_type: str = "kto",
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> jax.Array:
    """Per-example weighted losses (module docstring); ``desirable`` is bool (or 0/1)."""
    if loss_type not in KTO_LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r} is invalid: use one of {KTO_LOSS_TYPES}")
    r = jnp.asarray(policy, jnp.float32) - jnp.asarray(reference, jnp.float32)
    good = jnp.asarray(desirable) > 0
    z = jax.lax.stop_gradient(jnp.asarray(z0, jnp.float32))
    if loss_type == "kto":
        good_loss = 1.0 - jax.nn.sigmoid(beta * (r - z))
        bad_loss = 1.0 - jax.nn.sigmoid(beta * (z - r))
    else:
        good_loss = 1.0 - jax.nn.sigmoid(beta * r)
        bad_loss = jax.nn.sigmoid(beta * r)
    return jnp.where(good, desirable_weight * good_loss, undesirable_weight * bad_loss)


def kto_loss_terms(
    token_logp_BT: jax.Array,
    loss_mask_BT: jax.Array,
    segment_ids_BT: jax.Array,
    reference_BS: jax.Array,
    desirable_BS: jax.Array,
    z0: jax.Array | float,
    *,
    num_segments: int,
    beta: float = 0.1,
    loss_type: str = "kto",
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> LossTerms:
    """Numerator Σ_i ℓ_i and denominator N_examples of one packed micro-batch (one example per
    document); ``reference_BS`` / ``desirable_BS`` per document slot (slot 0 padding), ``z0``
    the step's constant. Metrics as (sum, count): ``rewards/chosen`` and ``rewards/rejected``
    (mean β r over desirable / undesirable examples), ``logps/chosen``, ``logps/rejected``,
    ``kl`` (z₀)."""
    seg_BT = segment_ids_BT.astype(jnp.int32)
    m_BT = (loss_mask_BT > 0) & (seg_BT > 0)
    lp_BT = jnp.where(m_BT, token_logp_BT.astype(jnp.float32), 0.0)
    policy_BS = segment_sum(lp_BT, seg_BT, num_segments)
    present_BS = documents_present(seg_BT, num_segments)
    ref_BS = jnp.where(present_BS, reference_BS.astype(jnp.float32), 0.0)
    good_BS = present_BS & (desirable_BS > 0)
    bad_BS = present_BS & ~(desirable_BS > 0)
    losses_BS = kto_loss(
        policy_BS,
        ref_BS,
        good_BS,
        z0=z0,
        beta=beta,
        loss_type=loss_type,
        desirable_weight=desirable_weight,
        undesirable_weight=undesirable_weight,
    )
    numerator = jnp.sum(jnp.where(present_BS, losses_BS, 0.0))
    denominator = jnp.sum(present_BS.astype(jnp.float32))
    reward_BS = jax.lax.stop_gradient(beta * (policy_BS - ref_BS))
    logp_BS = jax.lax.stop_gradient(policy_BS)
    on = lambda x_BS, sel_BS: jnp.sum(jnp.where(sel_BS, x_BS, 0.0))
    n_good, n_bad = jnp.sum(good_BS.astype(jnp.float32)), jnp.sum(bad_BS.astype(jnp.float32))
    metrics = {
        "rewards/chosen": (on(reward_BS, good_BS), n_good),
        "rewards/rejected": (on(reward_BS, bad_BS), n_bad),
        "logps/chosen": (on(logp_BS, good_BS), n_good),
        "logps/rejected": (on(logp_BS, bad_BS), n_bad),
        "kl": (jax.lax.stop_gradient(jnp.float32(z0)) * denominator, denominator),
    }
    return LossTerms(numerator, denominator, metrics)
