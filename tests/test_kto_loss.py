"""KTO's loss core (jaxrl.losses.kto): float64 references, TRL's formula on one device and one
micro-batch, split invariance, the global mismatched pairs and z₀ (docs/losses.md)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.losses.kto import kto_loss, kto_loss_terms, mismatched_completions, reference_point
from jaxrl.losses.normalize import finalize

BETA, W_D, W_U = 0.3, 1.0, 1.33


def _sig(x):
    return 1.0 / (1.0 + np.exp(-x))


def _packed(seed=0):
    """Two rows of unpaired examples (prompt, completion lengths); token log-probs, per-document
    reference sums and labels."""
    rng = np.random.default_rng(seed)
    rows = [[(2, 3), (1, 5), (4, 2)], [(3, 6), (2, 2)]]
    T, S = 24, 5
    seg = np.zeros((2, T), np.int32)
    mask = np.zeros((2, T), np.float32)
    for b, docs in enumerate(rows):
        t = 0
        for d, (p, c) in enumerate(docs, start=1):
            seg[b, t : t + p + c] = d
            mask[b, t + p - 1 : t + p + c - 1] = 1.0  # target-aligned completion tokens
            t += p + c
    lp = -rng.uniform(0.1, 2.0, size=(2, T)).astype(np.float32)
    ref = np.zeros((2, S), np.float32)
    ref[:, 1:] = -rng.uniform(2.0, 9.0, size=(2, S - 1))
    label = np.zeros((2, S), np.int32)
    label[0, 1:4], label[1, 1:3] = [1, 0, 1], [0, 1]
    return seg, mask, lp, ref, label, S


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_kto_value_and_gradient_match_float64(loss_type):
    seg, mask, lp, ref, label, S = _packed()
    z0 = 0.7

    def loss(x):
        t = kto_loss_terms(x, mask, seg, jnp.asarray(ref), jnp.asarray(label), z0,
                           num_segments=S, beta=BETA, loss_type=loss_type,
                           desirable_weight=W_D, undesirable_weight=W_U)  # fmt: skip
        return finalize(t.numerator, t.denominator), t

    (value, terms), grad = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(lp))
    want, want_grad, n = 0.0, np.zeros(lp.shape), 5
    for b in range(2):
        for d in range(1, seg[b].max() + 1):
            on = (seg[b] == d) & (mask[b] > 0)
            r = lp[b, on].astype(np.float64).sum() - ref[b, d]
            good = label[b, d] == 1
            if loss_type == "kto":
                x = BETA * (r - z0) if good else BETA * (z0 - r)
                ell, dr = 1 - _sig(x), -(_sig(x) * (1 - _sig(x))) * (BETA if good else -BETA)
            else:
                x = BETA * r
                ell = 1 - _sig(x) if good else _sig(x)
                dr = (-1 if good else 1) * BETA * _sig(x) * (1 - _sig(x))
            w = W_D if good else W_U
            want += w * ell / n
            want_grad[b, on] = w * dr / n
    np.testing.assert_allclose(float(value), want, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-5, atol=1e-9)
    assert float(terms.denominator) == n
    assert float(terms.metrics["rewards/chosen"][1]) == 3.0  # desirable examples
    assert float(terms.metrics["kl"][0] / terms.metrics["kl"][1]) == pytest.approx(z0)


def test_kto_matches_trl_formula_one_device_one_micro_batch():
    """TRL 1.16 ``KTOTrainer._compute_loss`` in torch: z₀ = clamp(mean(KL_logps −
    ref_KL_logps), 0), chosen 1 − σ(β(r − z₀)), rejected 1 − σ(β(z₀ − r)), weighted, nanmean.
    On one device and one micro-batch jaxrl's global Σ/Σ is the same number and gradient."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    n = 6
    logps = -rng.uniform(3.0, 9.0, size=n)
    ref = logps + rng.normal(0.0, 0.8, size=n)
    kl_pol, kl_ref = -rng.uniform(5, 12, size=n), -rng.uniform(5, 12, size=n)
    kl_ref = kl_pol - np.abs(rng.normal(0.5, 0.2, size=n))  # a positive mean: z₀ > 0
    labels = np.array([1, 0, 1, 1, 0, 0], bool)
    x = torch.tensor(logps, dtype=torch.float64, requires_grad=True)
    kl = (torch.tensor(kl_pol) - torch.tensor(kl_ref)).mean().clamp(min=0)
    r = x - torch.tensor(ref)
    chosen = 1 - torch.sigmoid(BETA * (r[torch.tensor(labels)] - kl))
    rejected = 1 - torch.sigmoid(BETA * (kl - r[torch.tensor(~labels)]))
    trl = torch.cat((W_D * chosen, W_U * rejected)).nanmean()
    trl.backward()
    z0 = reference_point(kl_pol, kl_ref)
    assert z0 == pytest.approx(float(kl), rel=1e-12) and z0 > 0

    def ours(p):
        return jnp.mean(kto_loss(p, jnp.asarray(ref), jnp.asarray(labels), z0=z0, beta=BETA,
                                 desirable_weight=W_D, undesirable_weight=W_U))  # fmt: skip

    value, grad = jax.value_and_grad(ours)(jnp.asarray(logps, jnp.float32))
    np.testing.assert_allclose(float(value), trl.item(), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), x.grad.numpy(), rtol=1e-5, atol=1e-9)


def test_step_is_the_same_however_the_examples_are_split():
    """Σ numerators / Σ denominators over micro-batches = the one-batch value; TRL's mean of
    per-micro-batch means is not (uneven batches), which is what this rules out."""
    seg, mask, lp, ref, label, S = _packed(seed=2)
    kw = dict(num_segments=S, beta=BETA, desirable_weight=W_D, undesirable_weight=W_U)
    whole = kto_loss_terms(lp, mask, seg, ref, label, 0.4, **kw)
    parts = [kto_loss_terms(lp[b : b + 1], mask[b : b + 1], seg[b : b + 1], ref[b : b + 1],
                            label[b : b + 1], 0.4, **kw) for b in range(2)]  # fmt: skip
    split = finalize(sum(p.numerator for p in parts), sum(p.denominator for p in parts))
    np.testing.assert_allclose(float(split), float(finalize(*whole[:2])), rtol=1e-7)
    means = np.mean([float(p.numerator / p.denominator) for p in parts])  # 3 and 2 examples
    assert abs(means - float(split)) > 1e-4


def test_mismatched_completions_are_a_seeded_derangement_of_the_global_batch():
    for n in (2, 3, 17):
        a = mismatched_completions(n, np.random.default_rng(7))
        b = mismatched_completions(n, np.random.default_rng(7))
        np.testing.assert_array_equal(a, b)
        assert sorted(a.tolist()) == list(range(n))  # every completion used once
        assert np.all(a != np.arange(n))  # never its own prompt's
    with pytest.raises(ValueError, match="at least 2 examples"):
        mismatched_completions(1, np.random.default_rng(0))


def test_reference_point_is_one_global_ratio_not_a_mean_of_device_means():
    """z₀ over the global batch: the same bits whatever the device count (it is computed once,
    on the host); TRL's mean of per-device means differs when the devices' batches differ."""
    rng = np.random.default_rng(1)
    pol = rng.normal(-5, 1, size=12).astype(np.float32)
    ref = (pol - rng.normal(0.3, 0.5, size=12)).astype(np.float32)
    z0 = reference_point(pol, ref)
    assert z0 == pytest.approx(float(np.mean(pol.astype(np.float64) - ref)), rel=1e-12)
    assert reference_point(pol, pol + 1.0) == 0.0  # clamped at 0, as TRL
    uneven = [slice(0, 2), slice(2, 12)]  # TRL: per-device mean, then the mean over devices
    trl = np.mean([np.mean(pol[s].astype(np.float64) - ref[s]) for s in uneven])
    assert abs(trl - z0) > 1e-3
