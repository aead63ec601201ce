"""PPO with a learned critic: token rewards, GAE and whitening on the host; the clipped value loss.

Host side (numpy, float64; docs/algorithms/ppo.md §2):

- :func:`token_rewards`: a completion's per-token rewards: −β·kl_t on every loss token (the KL
  of the generating policy against the reference, k1 or k3, when the KL is in the reward), plus
  the scalar reward on the last loss token.
- :func:`gae`: generalised advantage estimation over packed rows ``[R, T]``, reset at every
  document boundary (segment id change) inside a row. Only loss tokens are steps: a masked
  token (an environment's reply, padding) is skipped, as if it were not there.
- :func:`whiten`: (A − mean) / sqrt(var + 1e-8) over every loss token of the whole batch (one
  global mean and Bessel variance, never per device or per micro-batch).

Device side: :func:`value_loss_terms`, the clipped value loss as a token Σ/Σ (``LossTerms``), so
the engine's one global division makes it independent of the layout.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.losses.normalize import LossTerms

KL_ESTIMATORS = ("k1", "k3")
WHITEN_EPS = 1e-8  # TRL / tunix masked_whiten: (x − mean) · rsqrt(var + 1e-8)
VALUE_LOSS = "value_loss"
VALUE_MEAN = "value/mean"
VALUE_CLIPFRAC = "value/clipfrac"


def kl_penalty(old_logp: np.ndarray, ref_logp: np.ndarray, estimator: str) -> np.ndarray:
    """Per-token KL estimate of the generating policy against the reference (float64):
    k1 = log π_old − log π_ref; k3 = e^{ref−old} − (ref − old) − 1 (≥ 0, Schulman's)."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator={estimator!r} is invalid: use one of {KL_ESTIMATORS}")
    d = np.asarray(ref_logp, np.float64) - np.asarray(old_logp, np.float64)
    return -d if estimator == "k1" else np.expm1(d) - d


def token_rewards(
    reward: float, mask: np.ndarray, kl: np.ndarray | None = None, beta: float = 0.0
) -> np.ndarray:
    """One completion's float64 token rewards: −β·kl_t on loss tokens (``kl`` None: no KL
    in the reward), plus ``reward`` on the last loss token; 0 off the mask."""
    on = np.asarray(mask) > 0
    r = np.zeros(on.shape, np.float64)
    if kl is not None and beta:
        r = np.where(on, -beta * np.asarray(kl, np.float64), 0.0)
    idx = np.flatnonzero(on)
    if idx.size:
        r[idx[-1]] += reward
    return r


def gae(
    rewards_RT: np.ndarray,
    values_RT: np.ndarray,
    mask_RT: np.ndarray,
    segment_ids_RT: np.ndarray,
    *,
    gamma: float,
    lam: float,
) -> tuple[np.ndarray, np.ndarray]:
    """``(advantages, returns)`` float64 ``[R, T]`` of packed rows (GAE, Schulman et al. 2016).

    Per document (a run of equal nonzero segment ids) over its loss tokens t₁ < … < t_n:
    δ_k = r_k + γ·V_{k+1} − V_k with V_{n+1} = 0 (the document ends: terminal),
    A_k = δ_k + γλ·A_{k+1}, R_k = A_k + V_k. Tokens off the mask and padding (segment 0) get
    0 and are skipped: the recursion passes through them. γ = λ = 1 gives A_k = Σ_{j≥k} r_j − V_k.
    """
    r = np.asarray(rewards_RT, np.float64)
    v = np.asarray(values_RT, np.float64)
    on = (np.asarray(mask_RT) > 0) & (np.asarray(segment_ids_RT) > 0)
    seg = np.asarray(segment_ids_RT)
    adv = np.zeros(r.shape, np.float64)
    rows = r.shape[0]
    next_v, next_a = np.zeros(rows), np.zeros(rows)
    next_seg = np.full(rows, -1, seg.dtype if seg.size else np.int64)
    for t in range(r.shape[1] - 1, -1, -1):
        new_doc = seg[:, t] != next_seg  # the document after t has ended: reset
        next_v = np.where(new_doc, 0.0, next_v)
        next_a = np.where(new_doc, 0.0, next_a)
        next_seg = seg[:, t]
        a = r[:, t] + gamma * next_v - v[:, t] + gamma * lam * next_a
        adv[:, t] = np.where(on[:, t], a, 0.0)
        next_v = np.where(on[:, t], v[:, t], next_v)
        next_a = np.where(on[:, t], a, next_a)
    returns = np.where(on, adv + v, 0.0)
    return adv, returns


def whiten(values: Sequence[np.ndarray], masks: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Every array whitened with ONE mean and Bessel variance over the loss tokens of all of
    them (the whole batch): (x − mean) / sqrt(var + 1e-8); 0 off the mask. float64."""
    on = [np.asarray(m) > 0 for m in masks]
    flat = np.concatenate([np.asarray(x, np.float64)[o] for x, o in zip(values, on, strict=True)])
    if flat.size == 0:
        return [np.zeros(np.shape(x)) for x in values]
    mean = flat.mean()
    var = flat.var(ddof=1) if flat.size > 1 else 0.0
    scale = 1.0 / np.sqrt(var + WHITEN_EPS)
    return [
        np.where(o, (np.asarray(x, np.float64) - mean) * scale, 0.0)
        for x, o in zip(values, on, strict=True)
    ]


def value_loss_terms(
    values_BT: jax.Array,
    old_values_BT: jax.Array,
    returns_BT: jax.Array,
    loss_mask_BT: jax.Array,
    segment_ids_BT: jax.Array,
    *,
    clip_range_value: float,
    vf_coef: float = 1.0,
) -> LossTerms:
    """The clipped value loss (PPO2, TRL / verl ``clip_range_value``) as a token Σ/Σ:

        ℓ_t = vf_coef · ½ · max((V_t − R_t)², (clip(V_t, V_old_t ± ε_v) − R_t)²)

    numerator Σ_t m_t ℓ_t, denominator Σ_t m_t over the micro-batch's loss tokens; the engine
    sums both over micro-batches and ranks and divides once. Metrics (sum, count):
    ``value_loss`` (the loss without c_v, as TRL logs ``vf_loss``), ``value/mean`` (V over
    loss tokens) and ``value/clipfrac`` (tokens where the clipped branch is the larger)."""
    on = (loss_mask_BT > 0) & (segment_ids_BT > 0)
    v = values_BT.astype(jnp.float32)
    old = old_values_BT.astype(jnp.float32)
    ret = returns_BT.astype(jnp.float32)
    clipped = old + jnp.clip(v - old, -clip_range_value, clip_range_value)
    plain, clip = jnp.square(v - ret), jnp.square(clipped - ret)
    loss_BT = 0.5 * jnp.maximum(plain, clip)
    total = jnp.sum(jnp.where(on, loss_BT, 0.0))
    count = jnp.sum(on.astype(jnp.float32))
    metrics = {
        VALUE_LOSS: (jax.lax.stop_gradient(total), count),  # without c_v, as TRL logs vf_loss
        VALUE_MEAN: (jnp.sum(jnp.where(on, jax.lax.stop_gradient(v), 0.0)), count),
        VALUE_CLIPFRAC: (jnp.sum(jnp.where(on & (clip > plain), 1.0, 0.0)), count),
    }
    return LossTerms(vf_coef * total, count, metrics)


def ppo_advantages(
    rewards_B: np.ndarray,
    values: Sequence[np.ndarray],
    masks: Sequence[np.ndarray],
    *,
    gamma: float,
    lam: float,
    kl: Sequence[np.ndarray] | None = None,
    beta: float = 0.0,
    whiten_advantages: bool = True,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """``(advantages, returns)`` float32 per completion token of a whole generation batch.

    Row i's completion tokens get :func:`token_rewards` (``rewards_B[i]`` on its last loss token,
    −β·kl_t on every loss token when ``kl`` is given), then :func:`gae` against the critic's
    ``values`` (V_old), each row its own document. Returns R = A + V are taken before
    whitening; the advantages are then whitened over every loss token of the batch
    (:func:`whiten`). Unscorable rows (NaN reward) get A = 0 and R = V_old and stay out of the
    whitening statistics.
    """
    r_B = np.asarray(rewards_B, np.float64)
    n = len(values)
    width = max((len(v) for v in values), default=0)
    rew_RT, val_RT, mask_RT = np.zeros((n, width)), np.zeros((n, width)), np.zeros((n, width))
    seg_RT = np.zeros((n, width), np.int32)
    for i, (v, m) in enumerate(zip(values, masks, strict=True)):
        scorable = not np.isnan(r_B[i])
        on = (np.asarray(m) > 0) & scorable
        k = None if kl is None else kl[i]
        rew_RT[i, : len(v)] = token_rewards(r_B[i] if scorable else 0.0, on, k, beta)
        val_RT[i, : len(v)] = v
        mask_RT[i, : len(v)] = on
        seg_RT[i, : len(v)] = 1
    adv_RT, ret_RT = gae(rew_RT, val_RT, mask_RT, seg_RT, gamma=gamma, lam=lam)
    lengths = [len(v) for v in values]
    adv = [adv_RT[i, :c] for i, c in enumerate(lengths)]
    on_rows = [mask_RT[i, :c] for i, c in enumerate(lengths)]
    if whiten_advantages:
        adv = whiten(adv, on_rows)
    returns = [
        np.where(o > 0, ret_RT[i, : len(o)], np.asarray(values[i], np.float64))
        for i, o in enumerate(on_rows)
    ]
    return [a.astype(np.float32) for a in adv], [r.astype(np.float32) for r in returns]


def explained_variance(
    returns: Sequence[np.ndarray], values: Sequence[np.ndarray], masks: Sequence[np.ndarray]
) -> float:
    """1 − Var(R − V) / Var(R) over the batch's loss tokens (NaN when Var(R) = 0)."""
    on = [np.asarray(m) > 0 for m in masks]
    r = np.concatenate([np.asarray(x, np.float64)[o] for x, o in zip(returns, on, strict=True)])
    v = np.concatenate([np.asarray(x, np.float64)[o] for x, o in zip(values, on, strict=True)])
    var = r.var() if r.size else 0.0
    return float(1.0 - (r - v).var() / var) if var > 0 else float("nan")
