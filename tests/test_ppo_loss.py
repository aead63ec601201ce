"""PPO's numerics (jaxrl.losses.ppo): GAE on packed rows against a plain-Python loop, γ = λ = 1,
global whitening, token rewards with the KL, and the clipped value loss against float64
(docs/algorithms/ppo.md)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.losses.normalize import finalize
from jaxrl.losses.ppo import (
    gae,
    kl_penalty,
    ppo_advantages,
    token_rewards,
    value_loss_terms,
    whiten,
)


def _packed_rows(seed: int, rows: int = 3, t: int = 29):
    """Random packed rows: documents of random lengths, some masked tokens inside documents
    (an environment's reply), padding (segment 0) at the end of each row."""
    rng = np.random.default_rng(seed)
    seg = np.zeros((rows, t), np.int32)
    mask = np.zeros((rows, t), np.float32)
    for b in range(rows):
        pos, d = 0, 0
        while pos < t - 3:
            n = min(int(rng.integers(1, 9)), t - 3 - pos)
            d += 1
            seg[b, pos : pos + n] = d
            mask[b, pos : pos + n] = rng.random(n) < 0.8
            pos += n
    rewards = rng.normal(size=(rows, t))
    values = rng.normal(size=(rows, t))
    return rewards, values, mask, seg


def _gae_loop(rewards, values, mask, seg, gamma, lam):
    """The definition, document by document, in plain Python."""
    adv = np.zeros(rewards.shape)
    ret = np.zeros(rewards.shape)
    for b in range(rewards.shape[0]):
        for d in set(seg[b].tolist()) - {0}:
            idx = [t for t in range(rewards.shape[1]) if seg[b, t] == d and mask[b, t] > 0]
            a_next, v_next = 0.0, 0.0
            for t in reversed(idx):
                delta = rewards[b, t] + gamma * v_next - values[b, t]
                a_next = delta + gamma * lam * a_next
                v_next = values[b, t]
                adv[b, t] = a_next
                ret[b, t] = a_next + values[b, t]
    return adv, ret


@pytest.mark.parametrize("seed,gamma,lam", [(0, 0.99, 0.95), (1, 1.0, 0.9), (2, 0.9, 0.0)])
def test_gae_matches_plain_loop_on_packed_rows(seed, gamma, lam):
    rewards, values, mask, seg = _packed_rows(seed)
    adv, ret = gae(rewards, values, mask, seg, gamma=gamma, lam=lam)
    want_adv, want_ret = _gae_loop(rewards, values, mask, seg, gamma, lam)
    np.testing.assert_allclose(adv, want_adv, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ret, want_ret, rtol=1e-12, atol=1e-12)


def test_gae_gamma_lambda_one_is_return_to_go_minus_value():
    rewards, values, mask, seg = _packed_rows(3)
    adv, ret = gae(rewards, values, mask, seg, gamma=1.0, lam=1.0)
    on = (mask > 0) & (seg > 0)
    for b in range(seg.shape[0]):
        for t in np.flatnonzero(on[b]):
            later = on[b] & (seg[b] == seg[b, t]) & (np.arange(seg.shape[1]) >= t)
            assert adv[b, t] == pytest.approx(rewards[b, later].sum() - values[b, t], abs=1e-12)
            assert ret[b, t] == pytest.approx(rewards[b, later].sum(), abs=1e-12)
    assert np.all(adv[~on] == 0) and np.all(ret[~on] == 0)


def test_gae_resets_at_document_boundaries():
    """Packing two documents in one row gives each the values it has alone."""
    rewards, values, mask, seg = _packed_rows(4, rows=1, t=40)
    adv, _ = gae(rewards, values, mask, seg, gamma=0.97, lam=0.9)
    for d in set(seg[0].tolist()) - {0}:
        cols = seg[0] == d
        one = gae(rewards[:, cols], values[:, cols], mask[:, cols], np.ones((1, cols.sum())),
                  gamma=0.97, lam=0.9)[0]  # fmt: skip
        np.testing.assert_allclose(adv[:, cols], one, rtol=0, atol=1e-15)


def test_whiten_is_global_and_split_invariant():
    rng = np.random.default_rng(5)
    xs = [rng.normal(size=n) * 3 + 1 for n in (4, 7, 2, 9)]
    ms = [rng.random(x.size) < 0.7 for x in xs]
    out = whiten(xs, ms)
    flat = np.concatenate([x[m] for x, m in zip(xs, ms, strict=True)])
    want = (flat - flat.mean()) / np.sqrt(flat.var(ddof=1) + 1e-8)
    got = np.concatenate([o[m] for o, m in zip(out, ms, strict=True)])
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert all(np.all(o[~m] == 0) for o, m in zip(out, ms, strict=True))
    # one array or four: the same numbers (the statistics are the batch's, not a part's)
    joined = whiten([np.concatenate(xs)], [np.concatenate(ms)])[0]
    np.testing.assert_array_equal(joined, np.concatenate(out))


def test_token_rewards_and_kl_estimators():
    old = np.array([-1.0, -2.0, -0.5, -3.0])
    ref = np.array([-1.5, -1.0, -0.5, -2.0])
    k1 = kl_penalty(old, ref, "k1")
    np.testing.assert_allclose(k1, old - ref)
    d = ref - old
    np.testing.assert_allclose(kl_penalty(old, ref, "k3"), np.exp(d) - d - 1)
    mask = np.array([1, 1, 1, 0])
    r = token_rewards(2.0, mask, k1, beta=0.1)
    np.testing.assert_allclose(r, [-0.1 * k1[0], -0.1 * k1[1], 2.0 - 0.1 * k1[2], 0.0])
    np.testing.assert_array_equal(token_rewards(1.0, mask), [0, 0, 1, 0])
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_penalty(old, ref, "k2")


def test_value_loss_value_and_gradient_match_float64():
    rng = np.random.default_rng(6)
    v = rng.normal(size=(2, 11)).astype(np.float32)
    old = (v + rng.normal(scale=0.3, size=v.shape)).astype(np.float32)
    ret = rng.normal(size=v.shape).astype(np.float32)
    mask = (rng.random(v.shape) < 0.7).astype(np.float32)
    seg = np.ones(v.shape, np.int32)
    seg[:, -2:] = 0  # padding: never in the loss
    eps, coef = 0.2, 0.5

    def loss(x):
        t = value_loss_terms(x, old, ret, mask, seg, clip_range_value=eps, vf_coef=coef)
        return finalize(t.numerator, t.denominator), t

    (value, terms), grad = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(v))
    v64, o64, r64 = (np.asarray(a, np.float64) for a in (v, old, ret))
    on = (mask > 0) & (seg > 0)
    clipped = np.clip(v64, o64 - eps, o64 + eps)
    plain, clip = (v64 - r64) ** 2, (clipped - r64) ** 2
    want = (0.5 * coef * np.maximum(plain, clip))[on].sum() / on.sum()
    # d/dV: the larger branch's derivative; the clipped branch is constant outside the band
    inside = np.abs(v64 - o64) < eps
    d_clip = np.where(inside, 2 * (clipped - r64), 0.0)
    g = np.where(clip > plain, d_clip, 2 * (v64 - r64)) * 0.5 * coef / on.sum()
    assert float(value) == pytest.approx(want, rel=1e-6)
    np.testing.assert_allclose(np.asarray(grad), np.where(on, g, 0.0), rtol=1e-5, atol=1e-7)
    total, count = terms.metrics["value_loss"]
    assert float(total / count) == pytest.approx(want / coef, rel=1e-6)  # logged without c_v
    assert float(terms.metrics["value/mean"][0] / count) == pytest.approx(v64[on].mean(), rel=1e-5)


def test_ppo_advantages_returns_before_whitening_and_unscorable_rows():
    rng = np.random.default_rng(7)
    values = [rng.normal(size=n) for n in (3, 5, 2)]
    masks = [np.array([1, 1, 1]), np.array([1, 0, 1, 1, 1]), np.array([1, 1])]
    kl = [rng.normal(size=v.size) * 0.1 for v in values]
    rewards = np.array([1.0, 0.0, np.nan])  # the last row is unscorable
    adv, ret = ppo_advantages(rewards, values, masks, gamma=0.9, lam=0.8, kl=kl, beta=0.2)
    raw, want_ret = [], []
    for r, v, m, k in zip(rewards[:2], values[:2], masks[:2], kl[:2], strict=True):
        rew = token_rewards(r, m, k, 0.2)
        a, g = gae(rew[None], v[None], m[None], np.ones((1, v.size)), gamma=0.9, lam=0.8)
        raw.append(a[0])
        want_ret.append(np.where(m > 0, g[0], v))
    for got, want in zip(ret[:2], want_ret, strict=True):  # R = A + V, before whitening
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(ret[2], values[2], rtol=1e-6)  # unscorable: R = V_old, A = 0
    assert np.all(adv[2] == 0)
    white = whiten(raw, masks[:2])
    for got, want in zip(adv[:2], white, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    on = np.concatenate([a[m > 0] for a, m in zip(adv[:2], masks[:2], strict=True)])
    assert abs(on.mean()) < 1e-6 and on.std(ddof=1) == pytest.approx(1.0, rel=1e-4)
