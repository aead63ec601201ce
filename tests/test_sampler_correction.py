"""Off-policy correction of the sampler/trainer gap (jaxrl.losses.sampler_correction): every mode
against a float64 loop over documents, the identity when both sides agree, and packing
invariance (docs/algorithms/grpo.md §7)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.losses.loss_types import CORRECTION_MODES
from jaxrl.losses.policy import policy_loss_terms
from jaxrl.losses.sampler_correction import sampler_weights

CAP = 1.5


def _batch(seed=0):
    """Two rows: documents of 5, 4 | 6 tokens, first token of each not a loss token, padding."""
    seg = np.array([[1, 1, 1, 1, 1, 2, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1, 0, 0, 0, 0]], np.int32)
    mask = ((seg > 0) & (np.roll(seg, 1, axis=1) == seg)).astype(np.float32)
    rng = np.random.default_rng(seed)
    old = -rng.uniform(0.1, 2.0, seg.shape).astype(np.float32)
    sampler = (old + rng.normal(0, 0.35, seg.shape)).astype(np.float32)
    old[seg == 0], sampler[seg == 0] = np.nan, -np.inf  # padding values must never count
    return seg, mask, old, sampler


def reference(seg, mask, old, sampler, mode, cap):
    """float64: weight per token (1 off the loss tokens), ratio mean and clipped fraction."""
    w = np.ones(seg.shape)
    ratios, clipped = [], []
    for b in range(seg.shape[0]):
        for d in sorted(set(seg[b].tolist()) - {0}):
            idx = np.nonzero((seg[b] == d) & (mask[b] > 0))[0]
            diff = old[b, idx].astype(np.float64) - sampler[b, idx].astype(np.float64)
            if mode.startswith("token"):
                for t, x in zip(idx, diff, strict=True):
                    r = math.exp(x)
                    ratios.append(r)
                    if mode == "token_truncate":
                        w[b, t], c = min(r, cap), r > cap
                    else:
                        c = not (1 / cap <= r <= cap)
                        w[b, t] = 0.0 if c else r
                    clipped.append(c)
                continue
            if not len(idx):
                continue
            r = math.exp(diff.sum() if mode != "sequence_geo_mask" else diff.mean())
            ratios.append(r)
            if mode == "sequence_truncate":
                value, c = min(r, cap), r > cap
            else:
                c = not (1 / cap <= r <= cap)
                value = 0.0 if c else (1.0 if mode == "sequence_geo_mask" else r)
            w[b, idx] = value
            clipped.append(c)
    return w, np.mean(ratios), np.mean(clipped), len(ratios)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("mode", CORRECTION_MODES)
def test_every_mode_matches_float64_reference(mode, seed):
    seg, mask, old, sampler = _batch(seed)
    w, metrics = sampler_weights(old, sampler, mask, seg, num_segments=3, mode=mode, cap=CAP)
    w_ref, mean_ref, frac_ref, count = reference(seg, mask, old, sampler, mode, CAP)
    np.testing.assert_allclose(np.asarray(w), w_ref, rtol=1e-5)
    s, c = metrics["sampler/is_ratio/mean"]
    assert float(c) == count
    np.testing.assert_allclose(float(s) / float(c), mean_ref, rtol=1e-5)
    s, c = metrics["sampler/is_clipped_frac"]
    assert float(s) / float(c) == pytest.approx(frac_ref)


def test_the_cases_exercise_both_sides_of_the_cap():
    """The random gaps cross C and 1/C in the token modes, and some document crosses C."""
    seg, mask, old, sampler = _batch(0)
    _, _, frac, _ = reference(seg, mask, old, sampler, "token_mask", CAP)
    assert 0 < frac < 1
    _, _, frac, _ = reference(seg, mask, old, sampler, "sequence_truncate", CAP)
    assert 0 < frac < 1


@pytest.mark.parametrize("mode", CORRECTION_MODES)
def test_identity_when_sampler_and_trainer_agree(mode):
    """Same log-probs on both sides: every weight is exactly 1 and the loss, its gradient and
    its metrics are bit for bit those without a correction."""
    seg, mask, old, _ = _batch(3)
    w, _ = sampler_weights(old, old, mask, seg, num_segments=3, mode=mode, cap=CAP)
    assert np.all(np.asarray(w) == 1.0)
    adv = jnp.asarray([[0.0, 1.0, -0.5], [0.0, 2.0, 0.0]])
    lp = jnp.asarray(np.nan_to_num(old) + 0.1)

    def terms(x, weight):
        return policy_loss_terms(x, jnp.asarray(old), None, adv, mask, seg, is_weight_BT=weight)

    for a, b in zip(jax.tree.leaves(terms(lp, w)), jax.tree.leaves(terms(lp, None)), strict=True):
        np.testing.assert_array_equal(a, b)
    g_w = jax.grad(lambda x: terms(x, w).numerator)(lp)
    g_0 = jax.grad(lambda x: terms(x, None).numerator)(lp)
    np.testing.assert_array_equal(g_w, g_0)


@pytest.mark.parametrize("mode", CORRECTION_MODES)
def test_packing_does_not_change_a_document_s_weights(mode):
    """Row 0's two documents packed together or each in its own row: the same weights."""
    seg, mask, old, sampler = _batch(5)
    w, _ = sampler_weights(old, sampler, mask, seg, num_segments=3, mode=mode, cap=CAP)
    split = np.zeros((2, 10), np.int32)
    split[0, :5], split[1, :4] = 1, 1
    cols = [np.r_[0:5, 9:10].tolist() + [9] * 4, list(range(5, 9)) + [9] * 6]
    take = lambda x: np.stack([x[0, c] for c in cols])
    w_split, _ = sampler_weights(
        take(old), take(sampler), take(mask) * (split > 0), split, num_segments=2, mode=mode,
        cap=CAP,
    )  # fmt: skip
    np.testing.assert_array_equal(np.asarray(w)[0, :5], np.asarray(w_split)[0, :5])
    np.testing.assert_array_equal(np.asarray(w)[0, 5:9], np.asarray(w_split)[1, :4])


def test_weights_scale_the_policy_term_not_the_kl():
    seg, mask, old, sampler = _batch(2)
    adv = jnp.asarray([[0.0, 1.0, -0.5], [0.0, 2.0, 0.0]])
    ref = np.nan_to_num(old) - 0.3
    lp = jnp.asarray(np.nan_to_num(old))
    zeros = jnp.zeros(seg.shape)
    kw = dict(beta=0.5, loss_type="dapo")
    with_kl = policy_loss_terms(lp, jnp.asarray(old), ref, adv, mask, seg, is_weight_BT=zeros, **kw)
    kl_only = policy_loss_terms(lp, jnp.asarray(old), ref, jnp.zeros_like(adv), mask, seg, **kw)
    np.testing.assert_allclose(float(with_kl.numerator), float(kl_only.numerator), rtol=1e-6)


def test_bad_settings():
    seg, mask, old, sampler = _batch()
    with pytest.raises(ValueError, match="importance_sampling_correction='tis' is invalid"):
        sampler_weights(old, sampler, mask, seg, num_segments=3, mode="tis", cap=2.0)
    with pytest.raises(ValueError, match="importance_sampling_cap=1.0 is invalid"):
        sampler_weights(old, sampler, mask, seg, num_segments=3, mode="token_mask", cap=1.0)
    from jaxrl import ConfigError, GRPOConfig

    with pytest.raises(ConfigError, match="importance_sampling_correction"):
        GRPOConfig(importance_sampling_correction="tis")
    with pytest.raises(ConfigError, match="importance_sampling_cap=0.5"):
        GRPOConfig(importance_sampling_correction="token_mask", importance_sampling_cap=0.5)
