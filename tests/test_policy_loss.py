"""GRPO-family policy loss on packed micro-batches: GRPO, GSPO, DAPO, Dr.GRPO, Fast-LLM GSPO, CISPO.

Every numeric check compares against an independent float64 loop over documents. "Example N"
is the worked example N of docs/algorithms/grpo.md §10; the Fast-LLM cases are those of
docs/algorithms/accumulation.md.
"""

import functools
import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.losses.loss_types import GRPO_LOSS_TYPES as LOSS_TYPES
from jaxrl.losses.normalize import finalize
from jaxrl.losses.policy import (
    clipped_surrogate,
    entropy_mask,
    entropy_threshold,
    k3_kl,
    policy_loss_terms,
)

CLIP_KEYS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
CISPO_CAP = 1.25  # ε_high of the CISPO cases: a cap on the IS weight the random ratios cross


def for_type(kind, **kw):
    """``kw`` for loss type ``kind``: CISPO caps the weight at ``epsilon_high`` (set), no δ."""
    if kind == "cispo":
        kw.pop("delta", None)
        kw["epsilon_high"] = CISPO_CAP
    return kw


# ----------------------------------------------------------------- packing helpers


def pack(rows, T, S):
    """rows: list of rows, each a list of (doc_len, prompt_len). Loss mask is target-aligned:
    position t predicts token t+1, so a document's loss positions are prompt_len−1 … len−2."""
    B = len(rows)
    seg = np.zeros((B, T), np.int32)
    mask = np.zeros((B, T), np.float32)
    for b, docs in enumerate(rows):
        t = 0
        for d, (length, prompt) in enumerate(docs, start=1):
            seg[b, t : t + length] = d
            mask[b, t + prompt - 1 : t + length - 1] = 1.0
            t += length
        assert t <= T and len(docs) < S
    return seg, mask


def random_inputs(seg, S, seed=0, spread=0.25):
    rng = np.random.default_rng(seed)
    shape = seg.shape
    lp = (-np.abs(rng.normal(size=shape)) - 0.05).astype(np.float32)
    old = (lp + spread * rng.normal(size=shape)).astype(np.float32)
    ref = (lp + 0.3 * rng.normal(size=shape)).astype(np.float32)
    adv = rng.normal(size=(seg.shape[0], S)).astype(np.float32)
    ent = rng.uniform(0.0, 2.0, size=shape).astype(np.float32)
    return lp, old, ref, adv, ent


# ----------------------------------------------------------------- float64 loop reference


def reference(
    lp,
    old,
    ref,
    adv,
    mask,
    seg,
    ent,
    *,
    loss_type,
    level,
    eps=0.2,
    eps_high=None,
    delta=None,
    beta=0.0,
    L=512,
    tau=None,
):
    """Loop over documents in float64: numerator, denominator, metric (sum, count) and the
    analytic gradient of the numerator w.r.t. lp (TRL formulas, inclusive clip boundaries)."""
    lp, old, ref, ent = (np.asarray(x, np.float64) for x in (lp, old, ref, ent))
    eps_high = eps if eps_high is None else eps_high
    lo, hi = 1 - eps, 1 + eps_high
    cap = math.inf if delta is None else delta
    num, tokens, n_seq = 0.0, 0, 0
    grad = np.zeros_like(lp)
    low = high = region = clip_count = 0.0
    kl_sum = ent_sum = 0.0
    for b in range(seg.shape[0]):
        for d in sorted(set(seg[b].tolist()) - {0}):
            n_seq += 1
            idx = np.nonzero((seg[b] == d) & (mask[b] > 0))[0]
            n = len(idx)
            a = float(adv[b, d])
            lr = lp[b, idx] - old[b, idx]
            rho = np.exp(lr) if level == "token" else np.full(n, np.exp(lr.mean()) if n else 1.0)
            rho_u = np.minimum(rho, cap)
            if loss_type == "cispo":  # sg(min(ρ, ε_high)) · A · lp, no clip width
                lo, hi = 0.0, eps_high
                obj = np.minimum(rho, hi) * a * lp[b, idx]
            else:
                obj = np.minimum(rho_u * a, np.clip(rho, lo, hi) * a)
            if a > 0:
                live = rho <= min(hi, cap)
            elif a < 0:
                live = (rho >= lo) & (rho <= max(hi, cap))
            else:
                live = np.zeros(n, bool)
            keep = np.ones(n) if tau is None else (ent[b, idx] >= tau).astype(np.float64)
            diff = ref[b, idx] - lp[b, idx]
            kl = np.exp(diff) - diff - 1
            loss = -obj * keep + beta * kl
            coef = 1.0 / max(n, 1) if loss_type == "grpo" else 1.0
            num += coef * loss.sum()
            tokens += n
            dpol = -keep * a * live * rho  # ∂(policy loss_t)/∂(log ρ_t)
            if level == "sequence" and n:
                dpol = np.full(n, dpol.sum() / n)
            if loss_type == "cispo":  # the weight is not differentiated: ∂ℓ_t/∂lp_t = −w·A
                dpol = -keep * a * np.minimum(rho, hi)
            grad[b, idx] += coef * (dpol + beta * (1 - np.exp(diff)))
            lo_hit = (rho_u < lo) & (a < 0)
            hi_hit = (rho_u > hi) & (a > 0)
            if level == "token":
                low, high = low + lo_hit.sum(), high + hi_hit.sum()
                region += (lo_hit | hi_hit).sum()
                clip_count += n
            else:
                r_d = min(math.exp(lr.mean()) if n else 1.0, cap)
                low += (r_d < lo) and a < 0
                high += (r_d > hi) and a > 0
                region += ((r_d < lo) and a < 0) or ((r_d > hi) and a > 0)
                clip_count += 1
            kl_sum += kl.sum()
            ent_sum += ent[b, idx].sum()
    den = {
        "grpo": n_seq,
        "bnpo": tokens,
        "dapo": tokens,
        "dr_grpo": n_seq * L,
        "seq_mean_token_sum": n_seq,
        "cispo": tokens,
    }[loss_type]
    metrics = {
        "clip_ratio/low_mean": (low, clip_count),
        "clip_ratio/high_mean": (high, clip_count),
        "clip_ratio/region_mean": (region, clip_count),
        "entropy": (ent_sum, tokens),
    }
    if beta:
        metrics["kl"] = (kl_sum, tokens)
    return num, den, metrics, grad


def terms_and_grad(lp, *args, **kw):
    fn = lambda x: policy_loss_terms(x, *args, **kw)
    terms = fn(jnp.asarray(lp))
    grad = jax.grad(lambda x: fn(x).numerator)(jnp.asarray(lp))
    return terms, np.asarray(grad)


# ----------------------------------------------------------------- random cases vs reference

ROWS = [[(9, 3), (5, 2), (12, 4)], [(20, 6), (2, 2), (7, 1)], [(1, 1), (30, 5)]]
VARIANTS = {
    "plain": dict(),
    "delta_asym": dict(epsilon=0.1, epsilon_high=0.28, delta=1.25),
    "kl_entropy": dict(beta=0.04, top_entropy_quantile=0.6),
}


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_matches_float64_reference(loss_type, level, variant):
    S, T = 4, 40
    seg, mask = pack(ROWS, T, S)
    seed = zlib.crc32(f"{loss_type}/{level}/{variant}".encode())
    lp, old, ref, adv, ent = random_inputs(seg, S, seed=seed)
    kw = for_type(loss_type, **VARIANTS[variant])
    q = kw.pop("top_entropy_quantile", None)
    tau = tau_ref = None
    if q is not None:
        tau = entropy_threshold(jnp.asarray(ent), jnp.asarray(mask), q)
        np.testing.assert_allclose(float(tau), np.quantile(ent[mask > 0], 1 - q), rtol=1e-6)
        tau_ref = float(tau)  # same threshold in both, so the kept set is identical
    terms, grad = terms_and_grad(
        lp,
        old,
        ref,
        adv,
        mask,
        seg,
        ent,
        loss_type=loss_type,
        importance_sampling_level=level,
        max_completion_length=16,
        entropy_threshold=tau,
        **kw,
    )
    num, den, metrics, grad_ref = reference(
        lp,
        old,
        ref,
        adv,
        mask,
        seg,
        ent,
        loss_type=loss_type,
        level=level,
        L=16,
        eps=kw.get("epsilon", 0.2),
        eps_high=kw.get("epsilon_high"),
        delta=kw.get("delta"),
        beta=kw.get("beta", 0.0),
        tau=tau_ref,
    )
    np.testing.assert_allclose(float(terms.numerator), num, rtol=1e-5, atol=1e-6)
    assert float(terms.denominator) == den
    assert set(terms.metrics) == set(metrics)
    for key, (s, c) in metrics.items():
        np.testing.assert_allclose(float(terms.metrics[key][0]), s, rtol=1e-5, atol=1e-6)
        assert float(terms.metrics[key][1]) == c, key
    np.testing.assert_allclose(grad, grad_ref, rtol=1e-5, atol=1e-6)
    if variant == "plain" and level == "token":  # the data must exercise clipping
        assert metrics["clip_ratio/low_mean"][0] > 0 or metrics["clip_ratio/high_mean"][0] > 0


def test_jit_equals_eager():
    S, T = 4, 40
    seg, mask = pack(ROWS, T, S)
    lp, old, ref, adv, ent = random_inputs(seg, S, seed=3)
    fn = functools.partial(
        policy_loss_terms,
        loss_type="grpo",
        importance_sampling_level="sequence",
        beta=0.1,
        delta=1.5,
    )
    eager = fn(lp, old, ref, adv, mask, seg, ent)
    jitted = jax.jit(fn)(lp, old, ref, adv, mask, seg, ent)
    for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)


# ----------------------------------------------------------------- example 15 (+ invariance)

EX15 = {
    "grpo": 0.0,
    "bnpo": 1 / 3,
    "dr_grpo": 0.25,
    "dapo": 1 / 3,
    "seq_mean_token_sum": 1.0,
    "cispo": 0.0,  # −w·A·lp with lp = 0
}


def _ex15_batch(docs):
    """On-policy micro-batch of the given (length, advantage) sequences, one row."""
    T = sum(n for n, _ in docs)
    seg = np.concatenate([np.full(n, i + 1) for i, (n, _) in enumerate(docs)])[None]
    adv = np.array([[0.0] + [a for _, a in docs] + [0.0] * (3 - len(docs))], np.float32)
    return jnp.zeros((1, T)), jnp.ones((1, T)), jnp.asarray(seg, jnp.int32), jnp.asarray(adv)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_example_15_one_and_two_micro_batches(loss_type):
    lp, m, seg, adv = _ex15_batch([(2, 1.0), (4, -1.0)])
    kw = for_type(loss_type, max_completion_length=4)
    t = policy_loss_terms(lp, None, None, adv, m, seg, loss_type=loss_type, **kw)
    np.testing.assert_allclose(
        float(finalize(t.numerator, t.denominator)), EX15[loss_type], rtol=1e-6
    )
    parts = []
    for doc in [(2, 1.0), (4, -1.0)]:
        lp1, m1, seg1, adv1 = _ex15_batch([doc])
        parts.append(policy_loss_terms(lp1, None, None, adv1, m1, seg1, loss_type=loss_type, **kw))
    total = finalize(sum(p.numerator for p in parts), sum(p.denominator for p in parts))
    np.testing.assert_allclose(float(total), EX15[loss_type], rtol=1e-6)
    if loss_type == "bnpo":  # TRL's per-micro-batch bnpo averages the two means: 0, not 1/3
        trl = np.mean([float(p.numerator / p.denominator) for p in parts])
        assert trl == pytest.approx(0.0) and float(total) != pytest.approx(trl)


def _layout_terms(theta, layout, flat, S, T, **kw):
    """Sum of terms over the micro-batches of a layout; per-token logps gathered from theta."""
    starts = np.cumsum([0] + flat["lengths"])
    num = den = 0.0
    metrics = None
    for mb in layout:
        B = len(mb)
        idx = np.full((B, T), -1)
        seg = np.zeros((B, T), np.int32)
        mask = np.zeros((B, T), np.float32)
        adv = np.zeros((B, S), np.float32)
        for b, docs in enumerate(mb):
            t = 0
            for slot, d in enumerate(docs, start=1):
                n = flat["lengths"][d]
                idx[b, t : t + n] = np.arange(starts[d], starts[d] + n)
                seg[b, t : t + n] = slot
                mask[b, t : t + n] = flat["mask"][d]
                adv[b, slot] = flat["adv"][d]
                t += n
        pad = idx < 0
        safe_idx = np.where(pad, 0, idx)

        def take(x, fill, pad=pad, safe_idx=safe_idx):
            return jnp.where(pad, fill, x[safe_idx])

        terms = policy_loss_terms(
            take(theta, jnp.nan),
            take(flat["old"], jnp.nan),
            take(flat["ref"], jnp.nan),
            jnp.asarray(adv),
            mask,
            seg,
            take(flat["ent"], jnp.nan),
            **kw,
        )
        num, den = num + terms.numerator, den + terms.denominator
        metrics = (
            terms.metrics if metrics is None else jax.tree.map(jnp.add, metrics, terms.metrics)
        )
    return num, den, metrics


@pytest.mark.slow
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_layout_invariance_value_gradient_and_metrics(loss_type, level):
    """Same documents as one micro-batch of 2 rows, or 3 micro-batches in another order:
    Σ numerators / Σ denominators and its gradient are identical (docs/algorithms/grpo.md §8,
    docs/algorithms/accumulation.md §1.5)."""
    rng = np.random.default_rng(7)
    lengths = [9, 14, 5, 11, 3]
    mask = [(np.arange(n) >= 2) & (np.arange(n) < n - 1) for n in lengths]
    total = sum(lengths)
    flat = {
        "lengths": lengths,
        "mask": mask,
        "adv": rng.normal(size=5).astype(np.float32),
        "old": jnp.asarray(rng.normal(size=total) * 0.3 - 1.0, jnp.float32),
        "ref": jnp.asarray(rng.normal(size=total) * 0.3 - 1.0, jnp.float32),
        "ent": jnp.asarray(rng.uniform(0, 2, size=total), jnp.float32),
    }
    theta = jnp.asarray(np.asarray(flat["old"]) + rng.normal(size=total) * 0.25, jnp.float32)
    loss_tokens = np.concatenate(mask)
    tau = entropy_threshold(flat["ent"], jnp.asarray(loss_tokens), 0.7)
    kw = for_type(
        loss_type,
        loss_type=loss_type,
        importance_sampling_level=level,
        beta=0.05,
        delta=1.6,
        max_completion_length=16,
        entropy_threshold=tau,
    )
    one = [[[0, 1, 2], [3, 4]]]
    three = [[[4, 0]], [[2]], [[1, 3]]]
    results = []
    for layout, T in ((one, 32), (three, 28)):

        def loss_fn(th, layout=layout, T=T):
            num, den, metrics = _layout_terms(th, layout, flat, 4, T, **kw)
            return finalize(num, den), metrics

        (value, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(theta)
        results.append((float(value), np.asarray(grad), metrics))
    (v1, g1, m1), (v3, g3, m3) = results
    np.testing.assert_allclose(v1, v3, rtol=1e-6)
    np.testing.assert_allclose(g1, g3, rtol=1e-5, atol=1e-7)
    for key in m1:
        np.testing.assert_allclose(m1[key], m3[key], rtol=1e-6)
    assert np.any(g1 != 0)


# ----------------------------------------------------------------- example 16 (DAPO window)


@pytest.mark.slow
def test_example_16_dapo_window_normaliser():
    """Window of g=2 micro-steps from a buffer of S=4 slices: jaxrl divides by the window's own
    loss tokens. TRL's snapshot divides by the generation batch's tokens (off by S/g)."""
    rng = np.random.default_rng(2)

    def slice_terms(lengths):
        seg, mask = pack([[(n, 1) for n in lengths]], sum(lengths), len(lengths) + 1)
        adv = jnp.asarray(rng.normal(size=(1, len(lengths) + 1)), jnp.float32)
        return policy_loss_terms(
            jnp.zeros(seg.shape), None, None, adv, mask, seg, loss_type="dapo"
        ), mask.sum()

    for window_lengths, gen_factor in (([[6, 6], [6, 6]], 2), ([[3, 9, 4], [12]], 2)):
        terms = [slice_terms(ls) for ls in window_lengths]
        num = sum(float(t.numerator) for t, _ in terms)
        tokens = sum(n for _, n in terms)
        ours = float(
            finalize(sum(t.numerator for t, _ in terms), sum(t.denominator for t, _ in terms))
        )
        np.testing.assert_allclose(ours, num / tokens, rtol=1e-6)  # the window's token mean
        if window_lengths[0] == window_lengths[1]:  # equal slices: TRL snapshot = half
            n_gen = tokens * gen_factor  # S=4 slices per generation, g=2 per window
            np.testing.assert_allclose(num / n_gen, ours / 2, rtol=1e-6)
    # S=8, g=32: a window holds 4 generation batches; TRL's normaliser is one batch's tokens
    terms = [slice_terms([5, 5]) for _ in range(32)]
    tokens = sum(n for _, n in terms)
    ours = float(finalize(sum(t.numerator for t, _ in terms), sum(t.denominator for t, _ in terms)))
    num = sum(float(t.numerator) for t, _ in terms)
    np.testing.assert_allclose(ours, num / tokens, rtol=1e-5)
    np.testing.assert_allclose(num / (tokens / 4), 4 * ours, rtol=1e-5)


# ----------------------------------------------------------------- examples 17, 18, 21


def _k3_float64(ref, lp):
    """k3 in float64 numpy: ``exp(ref − lp) − (ref − lp) − 1``."""
    d = np.asarray(ref, np.float64) - np.asarray(lp, np.float64)
    return np.exp(d) - d - 1.0


def test_example_17_gspo_ratio_and_clip_metrics():
    lp = jnp.array([[0.1, 0.3]])
    old = jnp.zeros((1, 2))
    seg = jnp.array([[1, 1]])
    adv = jnp.array([[0.0, 1.0]])
    m = jnp.ones((1, 2))
    gspo = functools.partial(policy_loss_terms, lp, old, None, adv, m, seg, loss_type="grpo")
    # The sequence ratio itself: with ε_high wide enough nothing clips, ℓ = −ρ on both tokens.
    rho = np.exp(np.mean([0.1, 0.3], dtype=np.float64))
    wide = gspo(importance_sampling_level="sequence", epsilon_high=0.5)
    np.testing.assert_allclose(-float(wide.numerator), rho, rtol=1e-6)
    assert -float(wide.numerator) == pytest.approx(1.22140, abs=1e-5)  # the example's number
    assert float(wide.metrics["clip_ratio/high_mean"][0]) == 0.0
    # ε = 0.2: ρ = 1.2214 > 1.2 with A > 0, so the objective uses 1.2 and the sequence counts.
    t = gspo(importance_sampling_level="sequence")
    np.testing.assert_allclose(float(t.numerator), -1.2, rtol=1e-6)
    assert [float(x) for x in t.metrics["clip_ratio/high_mean"]] == [1.0, 1.0]
    assert float(t.metrics["clip_ratio/low_mean"][0]) == 0.0
    tok = gspo(importance_sampling_level="token")
    s, c = (float(x) for x in tok.metrics["clip_ratio/high_mean"])
    assert s / c == 0.5  # exp(0.3) = 1.35 clips, exp(0.1) = 1.105 does not
    want = np.mean([-np.exp(np.float64(0.1)), -1.2])  # grpo: token mean of the document
    np.testing.assert_allclose(float(tok.numerator), want, rtol=1e-6)


def test_example_18_k3():
    assert float(k3_kl(jnp.float32(0.5), jnp.float32(0.0))) == pytest.approx(0.14872, abs=1e-5)
    assert float(k3_kl(jnp.float32(-1.3), jnp.float32(-1.3))) == 0.0
    rng = np.random.default_rng(18)
    lp = -np.abs(rng.normal(size=(4, 9))).astype(np.float32) - 0.1
    ref = (lp + rng.uniform(-2.0, 2.0, size=lp.shape)).astype(np.float32)
    np.testing.assert_allclose(
        np.asarray(k3_kl(jnp.asarray(ref), jnp.asarray(lp))),
        _k3_float64(ref, lp),
        rtol=1e-5,
        atol=1e-6,
    )
    # masked positions: 0, and non-finite values there reach no gradient
    mask = rng.uniform(size=lp.shape) < 0.5
    poisoned = np.where(mask, ref, np.inf).astype(np.float32)
    got = np.asarray(k3_kl(jnp.asarray(poisoned), jnp.asarray(lp), jnp.asarray(mask)))
    np.testing.assert_allclose(got, np.where(mask, _k3_float64(ref, lp), 0.0), rtol=1e-5, atol=1e-6)
    grad = jax.grad(lambda x: jnp.sum(k3_kl(jnp.asarray(poisoned), x, jnp.asarray(mask))))
    g = np.asarray(grad(jnp.asarray(lp)))
    np.testing.assert_allclose(g, np.where(mask, 1.0 - np.exp(ref - lp.astype(np.float64)), 0.0),
                               rtol=1e-5, atol=1e-6)  # fmt: skip
    # Through the loss: on-policy, A = 0, so ℓ = β·k3 and the kl metric is its token mean.
    lp = jnp.array([[-1.0, -2.0, -0.5]])
    ref = lp + jnp.array([[0.5, 0.0, -0.2]])
    t = policy_loss_terms(
        lp,
        None,
        ref,
        jnp.zeros((1, 2)),
        jnp.ones((1, 3)),
        jnp.ones((1, 3), jnp.int32),
        loss_type="dapo",
        beta=0.1,
    )
    k = _k3_float64(ref, lp).sum()
    np.testing.assert_allclose(float(t.numerator), 0.1 * k, rtol=1e-5)
    np.testing.assert_allclose([float(x) for x in t.metrics["kl"]], [k, 3.0], rtol=1e-5)


def test_example_21_clip_signs():
    rho = [0.7, 0.7, 1.3, 1.3]
    adv = [-1.0, 1.0, 1.0, -1.0]
    lp = jnp.log(jnp.array([rho], jnp.float32))
    seg = jnp.array([[1, 2, 3, 4]])
    adv_BS = jnp.array([[0.0] + adv])
    for level in ("token", "sequence"):
        t = policy_loss_terms(
            lp,
            jnp.zeros((1, 4)),
            None,
            adv_BS,
            jnp.ones((1, 4)),
            seg,
            importance_sampling_level=level,
        )
        got = {k: [float(x) for x in t.metrics[k]] for k in CLIP_KEYS}
        assert got["clip_ratio/low_mean"] == [1.0, 4.0]  # only ρ=0.7, A=−1
        assert got["clip_ratio/high_mean"] == [1.0, 4.0]  # only ρ=1.3, A=+1
        assert got["clip_ratio/region_mean"] == [2.0, 4.0]


def test_on_policy_ratio_is_one_and_clip_metrics_zero():
    seg, mask = pack(ROWS, 40, 4)
    lp, _, _, adv, _ = random_inputs(seg, 4, seed=5)
    t, grad = terms_and_grad(lp, None, None, adv, mask, seg, loss_type="dapo")
    assert all(float(t.metrics[k][0]) == 0.0 for k in CLIP_KEYS)
    adv_tok = np.take_along_axis(adv, seg, axis=1) * mask
    np.testing.assert_allclose(float(t.numerator), -adv_tok.sum(), rtol=1e-5)
    np.testing.assert_allclose(grad, -adv_tok, rtol=1e-6)


# ----------------------------------------------------------------- example 19 (entropy mask)

ENT = jnp.array([[0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [0.7, 0.8, 0.9, 1.0, 1.1, 1.2]])
ENT_MASK = jnp.array([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])


@pytest.mark.parametrize(
    "level,kept",
    [
        (0.8, [0.9, 1.0]),
        (0.5, [0.6, 0.7, 0.8, 0.9, 1.0]),
        (0.0, [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]),
        (1.0, [1.0]),
    ],
)
def test_example_19_entropy_mask_levels(level, kept):
    tau = entropy_threshold(ENT, ENT_MASK, 1.0 - level)
    keep = entropy_mask(ENT, ENT_MASK, tau)
    np.testing.assert_allclose(np.sort(np.asarray(ENT)[np.asarray(keep)]), kept, rtol=1e-6)


def test_example_19_all_masked_keeps_nothing():
    tau = entropy_threshold(ENT, jnp.zeros_like(ENT_MASK), 0.5)
    assert not np.any(entropy_mask(ENT, jnp.zeros_like(ENT_MASK), tau))


@pytest.mark.parametrize("q", [0.05, 0.2, 0.37, 0.5, 0.9, 1.0])
def test_entropy_threshold_matches_numpy_quantile(q):
    rng = np.random.default_rng(int(q * 100))
    ent = rng.gamma(2.0, size=(3, 57)).astype(np.float32)
    mask = rng.uniform(size=(3, 57)) < 0.6
    want = np.quantile(ent[mask].astype(np.float64), 1 - q)
    np.testing.assert_allclose(float(entropy_threshold(ent, mask, q)), want, rtol=1e-6)


def test_entropy_mask_gates_policy_term_but_not_kl():
    lp = jnp.full((1, 4), -1.0)
    ref = lp + 0.5
    ent = jnp.array([[0.1, 0.2, 0.9, 1.0]])
    adv = jnp.array([[0.0, 2.0]])
    seg, m = jnp.ones((1, 4), jnp.int32), jnp.ones((1, 4))
    t = policy_loss_terms(lp, None, ref, adv, m, seg, ent, beta=0.1, entropy_threshold=0.5)
    k3 = math.exp(0.5) - 1.5
    np.testing.assert_allclose(float(t.numerator), 2 * (-2.0) + 4 * 0.1 * k3, rtol=1e-6)
    np.testing.assert_allclose([float(x) for x in t.metrics["entropy"]], [2.2, 4.0], rtol=1e-6)


# ----------------------------------------------------------------- example 20 (all masked)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_example_20_all_masked_loss_zero_and_zero_gradient(loss_type, level):
    """Every completion truncated (mask ≡ 0): loss 0, no NaN, and a model's gradient is 0."""
    rng = np.random.default_rng(0)
    seg, _ = pack([[(6, 2), (5, 2)], [(8, 3)]], 12, 3)
    x = jnp.asarray(rng.normal(size=(2, 12, 5)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(5, 7)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 7, size=(2, 12)))
    adv = jnp.asarray(rng.normal(size=(2, 3)), jnp.float32)

    def loss(w):
        lp = jnp.take_along_axis(jax.nn.log_softmax(x @ w), y[..., None], axis=-1)[..., 0]
        t = policy_loss_terms(
            lp,
            lp + 0.3,
            lp - 0.2,
            adv,
            jnp.zeros((2, 12)),
            seg,
            **for_type(loss_type, loss_type=loss_type, importance_sampling_level=level, beta=0.1),
        )
        return finalize(t.numerator, t.denominator), t

    (value, t), grad = jax.value_and_grad(loss, has_aux=True)(w)
    assert float(value) == 0.0
    assert float(t.numerator) == 0.0
    np.testing.assert_array_equal(grad, np.zeros_like(grad))
    assert all(np.isfinite(float(s)) for s, _ in t.metrics.values())
    # grpo / dr_grpo / seq_mean_token_sum still count the 3 documents; dapo counts 0 tokens
    assert float(t.denominator) == {
        "grpo": 3,
        "dr_grpo": 3 * 512,
        "seq_mean_token_sum": 3,
        "dapo": 0,
        "bnpo": 0,
    }.get(
        loss_type,
        0,  # cispo: tokens, as dapo
    )


# ----------------------------------------------------------------- GSPO boundary (3.7)


@pytest.mark.parametrize(
    "rho,adv,expected",
    [
        (1.0 + 0.2, 1.0, 1.0),  # at 1 + ε_high with A > 0: the gradient still flows
        (1.0 - 0.2, -1.0, -1.0),  # at 1 − ε_low with A < 0: flows
        (1.3, 1.0, 0.0),
        (0.7, -1.0, 0.0),
        (0.7, 1.0, 1.0),
        (1.3, -1.0, -1.0),
    ],
)
def test_clip_boundary_gradient_is_inclusive(rho, adv, expected):
    r = jnp.float32(rho)
    g = jax.grad(
        lambda r: clipped_surrogate(r, jnp.float32(adv), epsilon_low=0.2, epsilon_high=0.2)
    )(r)
    assert float(g) == expected * 1.0
    value = clipped_surrogate(r, jnp.float32(adv), epsilon_low=0.2, epsilon_high=0.2)
    want = min(float(r) * adv, float(np.clip(r, np.float32(0.8), np.float32(1.2))) * adv)
    assert float(value) == pytest.approx(want, rel=1e-7)
    if rho in (1.2, 0.8):  # naive autodiff of min/clip splits the tie: proves the test can fail
        naive = jax.grad(lambda r: jnp.minimum(r * adv, jnp.clip(r, 0.8, 1.2) * adv))(r)
        assert float(naive) != expected


@pytest.mark.parametrize(
    "rho,adv,expected",
    [
        (3.0, -1.0, 0.0),  # A < 0 beyond δ: capped, no gradient
        (1.5, -1.0, -1.0),  # A < 0 above 1+ε but below δ: unclipped term, gradient flows
        (2.0, -1.0, -1.0),  # exactly δ: inclusive
        (1.15, 1.0, 1.0),
    ],
)
def test_delta_cap_gradient(rho, adv, expected):
    f = lambda r: clipped_surrogate(
        r, jnp.float32(adv), epsilon_low=0.2, epsilon_high=0.2, delta=2.0
    )
    assert float(jax.grad(f)(jnp.float32(rho))) == expected
    want = min(min(rho, 2.0) * adv, float(np.clip(rho, 0.8, 1.2)) * adv)
    assert float(f(jnp.float32(rho))) == pytest.approx(want, rel=1e-6)


# ------------------------------------------- docs/algorithms/accumulation.md §3 GSPO reference


def test_gspo_uneven_documents_forward_and_backward():
    """Documents of 17, 31, 58 and 94 tokens (D = 4), seq_mean_token_sum at sequence level:
    loss = Σ_d N_d · l_d / D; ∂loss/∂z_t = (1/D) m_t R_d g_d (softmax(z_t) − onehot(y_t))."""
    rng = np.random.default_rng(11)
    V, T = 16, 128
    seg, mask = pack([[(17, 4), (31, 4), (58, 4)], [(94, 4)]], T, 4)
    z = rng.normal(size=(2, T, V)).astype(np.float32)
    y = rng.integers(0, V, size=(2, T))
    lp64 = z.astype(np.float64) - np.log(np.exp(z.astype(np.float64)).sum(-1, keepdims=True))
    lp64 = np.take_along_axis(lp64, y[..., None], -1)[..., 0]
    shift = np.zeros((2, T))
    for (b, d), s in zip([(0, 1), (0, 2), (0, 3), (1, 1)], [0.5, -0.5, 0.05, -0.3], strict=True):
        shift[b][seg[b] == d] = s
    old = (lp64 - shift + 0.05 * rng.normal(size=(2, T))).astype(np.float32)
    adv = np.array([[0, 1.0, -1.0, 0.5], [0, 0.7, 0, 0]], np.float32)

    def loss(z):
        lp = jnp.take_along_axis(jax.nn.log_softmax(z), jnp.asarray(y)[..., None], -1)[..., 0]
        t = policy_loss_terms(
            lp,
            old,
            None,
            adv,
            mask,
            seg,
            loss_type="seq_mean_token_sum",
            importance_sampling_level="sequence",
        )
        return finalize(t.numerator, t.denominator), t

    (value, t), grad = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(z))
    assert float(t.denominator) == 4.0

    # Loop reference (docs/algorithms/accumulation.md §3): skip documents with no loss tokens,
    # add −min(...)·N_d, ÷D.
    total, g_ref = 0.0, np.zeros_like(z, np.float64)
    z64 = z.astype(np.float64)
    soft = np.exp(z64) / np.exp(z64).sum(-1, keepdims=True)
    onehot = np.eye(V)[y]
    clipped = 0
    for b, d in [(0, 1), (0, 2), (0, 3), (1, 1)]:
        sel = (seg[b] == d) & (mask[b] > 0)
        n = sel.sum()
        R = np.exp((lp64[b, sel] - old[b, sel]).mean())
        A = float(adv[b, d])
        total += -min(R * A, np.clip(R, 0.8, 1.2) * A) * n
        gd = max(A, 0) * (R <= 1.2) + min(A, 0) * (R >= 0.8)
        clipped += gd == 0
        g_ref[b, sel] = (1 / 4) * R * gd * (soft[b, sel] - onehot[b, sel])
    assert clipped == 2  # documents 1 and 2 are clipped, 3 and 4 are not
    np.testing.assert_allclose(float(value), total / 4, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), g_ref, rtol=1e-4, atol=1e-6)
    assert [float(x) for x in t.metrics["clip_ratio/region_mean"]] == [2.0, 4.0]


def test_gspo_gradient_matches_autodiff_of_jax_loop_reference():
    """Autodiff of a straightforward per-document loop (away from clip boundaries)."""
    rng = np.random.default_rng(12)
    seg, mask = pack([[(17, 4), (31, 4), (58, 4)], [(94, 4)]], 128, 4)
    lp = jnp.asarray(-np.abs(rng.normal(size=(2, 128))), jnp.float32)
    old = lp + jnp.asarray(rng.normal(size=(2, 128)) * 0.4, jnp.float32)
    adv = jnp.asarray(rng.normal(size=(2, 4)), jnp.float32)

    def loop(lp):
        total = 0.0
        for b, d in [(0, 1), (0, 2), (0, 3), (1, 1)]:
            sel = np.nonzero((seg[b] == d) & (mask[b] > 0))[0]
            R = jnp.exp(jnp.mean(lp[b, sel] - old[b, sel]))
            total += -jnp.minimum(R * adv[b, d], jnp.clip(R, 0.8, 1.2) * adv[b, d]) * len(sel)
        return total / 4

    def ours(lp):
        t = policy_loss_terms(
            lp,
            old,
            None,
            adv,
            mask,
            seg,
            loss_type="seq_mean_token_sum",
            importance_sampling_level="sequence",
        )
        return finalize(t.numerator, t.denominator)

    np.testing.assert_allclose(ours(lp), loop(lp), rtol=1e-5)
    np.testing.assert_allclose(jax.grad(ours)(lp), jax.grad(loop)(lp), rtol=1e-5, atol=1e-7)


# ---------------------------------------- docs/algorithms/accumulation.md §6 case 4: divisors


def test_divisor_linearity():
    rng = np.random.default_rng(4)
    # token-level GRPO: 16 tokens, vocabulary 32, old_lp = randn − 2
    z = rng.normal(size=(1, 16, 32)).astype(np.float32)
    y = rng.integers(0, 32, size=(1, 16))
    lp = jnp.take_along_axis(jax.nn.log_softmax(z), jnp.asarray(y)[..., None], -1)[..., 0]
    old = jnp.asarray(rng.normal(size=(1, 16)) - 2, jnp.float32)
    t = policy_loss_terms(
        lp,
        old,
        None,
        jnp.array([[0.0, 0.8]]),
        jnp.ones((1, 16)),
        jnp.ones((1, 16), jnp.int32),
        loss_type="dapo",
    )
    assert float(t.denominator) == 16
    np.testing.assert_allclose(
        finalize(t.numerator, 16.0), 2 * finalize(t.numerator, 32.0), rtol=1e-6
    )
    # GSPO: 12 tokens, vocabulary 16, three documents
    z = rng.normal(size=(1, 12, 16)).astype(np.float32)
    y = rng.integers(0, 16, size=(1, 12))
    lp = jnp.take_along_axis(jax.nn.log_softmax(z), jnp.asarray(y)[..., None], -1)[..., 0]
    seg = jnp.array([[1, 1, 1, 2, 2, 2, 3, 3, 3, 3, 3, 3]])
    old = lp + jnp.asarray(rng.normal(size=(1, 12)) * 0.2, jnp.float32)
    adv = jnp.asarray([[0.0, 1.0, -0.5, 0.3]])
    kw = dict(importance_sampling_level="sequence")
    gspo = policy_loss_terms(
        lp, old, None, adv, jnp.ones((1, 12)), seg, loss_type="seq_mean_token_sum", **kw
    )
    np.testing.assert_allclose(
        finalize(gspo.numerator, 12.0), 2 * finalize(gspo.numerator, 24.0), rtol=1e-6
    )
    # document- vs token-normalised: 12 tokens / 3 documents
    dapo = policy_loss_terms(lp, old, None, adv, jnp.ones((1, 12)), seg, loss_type="dapo", **kw)
    ratio = finalize(gspo.numerator, gspo.denominator) / finalize(dapo.numerator, dapo.denominator)
    np.testing.assert_allclose(ratio, 12 / 3, rtol=1e-4)


# ------------------------------------------------ docs/algorithms/accumulation.md §4 padding


@pytest.mark.slow
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_padded_row_is_bit_identical_to_unpadded(loss_type, level):
    """Documents [3, 4] unpadded (T = 7) and padded to T = 10 with garbage in the padding."""
    seg7 = np.array([[1, 1, 1, 2, 2, 2, 2]], np.int32)
    mask7 = np.array([[1, 1, 0, 1, 1, 1, 0]], np.float32)
    lp7, old7, ref7, _, ent7 = random_inputs(seg7, 3, seed=1, spread=0.4)
    adv = jnp.array([[0.0, 1.3, -0.7]])
    pad = lambda x, v: np.concatenate([x, np.full((1, 3), v, x.dtype)], axis=1)
    kw = for_type(
        loss_type,
        loss_type=loss_type,
        importance_sampling_level=level,
        beta=0.1,
        delta=1.4,
        entropy_threshold=jnp.float32(0.5),
    )
    t7, g7 = terms_and_grad(lp7, old7, ref7, adv, mask7, seg7, ent7, **kw)
    adv_pad = adv.at[0, 0].set(jnp.nan)
    t10, g10 = terms_and_grad(
        pad(lp7, np.nan),
        pad(old7, np.inf),
        pad(ref7, -np.inf),
        adv_pad,
        pad(mask7, 0),
        pad(seg7, 0),
        pad(ent7, np.nan),
        **kw,
    )
    for a, b in zip(jax.tree.leaves(t7), jax.tree.leaves(t10), strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(g10[:, :7], g7)
    np.testing.assert_array_equal(g10[:, 7:], 0.0)


@pytest.mark.slow
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_fully_padded_row_contributes_nothing(loss_type, level):
    kw = for_type(loss_type, loss_type=loss_type, importance_sampling_level=level, beta=0.1)
    S, T = 4, 40
    empty = np.zeros((1, T), np.int32)
    lp, old, ref, adv, ent = random_inputs(empty, S, seed=4)
    t, g = terms_and_grad(lp, old, ref, adv, np.ones((1, T)), empty, ent, **kw)
    assert all(float(x) == 0.0 for x in jax.tree.leaves(t))  # numerator, denominator, metrics
    np.testing.assert_array_equal(g, 0.0)
    # A real micro-batch plus one bucket-padding row equals the real micro-batch alone.
    seg, mask = pack(ROWS[:1], T, S)
    lp1, old1, ref1, adv1, ent1 = random_inputs(seg, S, seed=6)
    cat = lambda a, b: np.concatenate([a, b], axis=0)
    t1, g1 = terms_and_grad(lp1, old1, ref1, adv1, mask, seg, ent1, **kw)
    t2, g2 = terms_and_grad(
        cat(lp1, lp),
        cat(old1, old),
        cat(ref1, ref),
        cat(adv1, adv),
        cat(mask, np.ones((1, T), np.float32)),
        cat(seg, empty),
        cat(ent1, ent),
        **kw,
    )
    for a, b in zip(jax.tree.leaves(t1), jax.tree.leaves(t2), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    np.testing.assert_array_equal(g2[:1], g1)
    np.testing.assert_array_equal(g2[1:], 0.0)


# ----------------------------------------------------------------- argument checks


def test_argument_errors():
    lp, seg = jnp.zeros((1, 3)), jnp.ones((1, 3), jnp.int32)
    adv, m = jnp.zeros((1, 2)), jnp.ones((1, 3))
    with pytest.raises(ValueError, match="loss_type='ppo' is invalid"):
        policy_loss_terms(lp, None, None, adv, m, seg, loss_type="ppo")
    with pytest.raises(ValueError, match="caps the importance weight at epsilon_high"):
        policy_loss_terms(lp, None, None, adv, m, seg, loss_type="cispo")
    with pytest.raises(ValueError, match="takes no delta"):
        policy_loss_terms(lp, None, None, adv, m, seg, loss_type="cispo", epsilon_high=5.0, delta=2)
    with pytest.raises(ValueError, match="importance_sampling_level"):
        policy_loss_terms(lp, None, None, adv, m, seg, importance_sampling_level="seq")
    with pytest.raises(ValueError, match="needs ref_logp_BT"):
        policy_loss_terms(lp, None, None, adv, m, seg, beta=0.1)
    with pytest.raises(ValueError, match="needs entropy_BT"):
        policy_loss_terms(lp, None, None, adv, m, seg, entropy_threshold=jnp.float32(0.1))


def test_token_advantages_replace_the_document_advantage():
    """``token_adv_BT`` (REINFORCE++ with the KL in the reward): each token's own advantage in
    the clipped surrogate. Equal to the document's on every token it changes no bit; random
    per-token values match a float64 token loop (dapo: Σ m ℓ / Σ m)."""
    S, T = 4, 40
    seg, mask = pack(ROWS, T, S)
    lp, old, ref, adv, ent = random_inputs(seg, S, seed=7)
    per_doc = np.take_along_axis(adv, seg, axis=1)  # A_d on each token of document d
    base, base_grad = terms_and_grad(lp, old, ref, adv, mask, seg, ent, loss_type="dapo")
    same, same_grad = terms_and_grad(
        lp, old, ref, adv, mask, seg, ent, loss_type="dapo", token_adv_BT=per_doc
    )
    assert float(same.numerator) == float(base.numerator)
    np.testing.assert_array_equal(same_grad, base_grad)
    tok = np.random.default_rng(3).normal(size=seg.shape).astype(np.float32)
    terms, _ = terms_and_grad(lp, old, ref, adv, mask, seg, ent, loss_type="dapo", token_adv_BT=tok)
    m = (mask > 0) & (seg > 0)
    rho = np.exp(lp.astype(np.float64) - old)
    clipped = np.clip(rho, 0.8, 1.2)
    loss = -np.minimum(rho * tok, clipped * tok)
    np.testing.assert_allclose(float(terms.numerator), loss[m].sum(), rtol=1e-5, atol=1e-6)
    assert float(terms.denominator) == m.sum()


@pytest.mark.parametrize("on_policy", [True, False])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_bias_corrected_kl_value_and_gradient_float64(level, on_policy):
    """``kl_bias_correction`` (TRL ``use_bias_correction_kl``): ℓ_t = β ρ k3_t with the ratio
    differentiated. With A = 0 only the KL term is left; its value and gradient match float64:
    token level ∂/∂lp_t = β m_t ρ_t (k3_t + 1 − e^(ref_t−lp_t)); sequence level adds
    ρ_d Σ_{s∈d} m_s k3_s / N_d to every token of d. On-policy ρ = 1, and the gradient still
    differs from plain k3 by β k3_t (per token)."""
    S, T, beta = 4, 40, 0.1
    seg, mask = pack(ROWS, T, S)
    lp, old, ref, _, ent = random_inputs(seg, S, seed=32)
    if on_policy:
        old = lp.copy()
    zero = np.zeros((seg.shape[0], S), np.float32)
    kw = dict(loss_type="dapo", importance_sampling_level=level, beta=beta)
    terms, grad = terms_and_grad(
        lp, None if on_policy else old, ref, zero, mask, seg, ent, kl_bias_correction=True, **kw
    )
    m = (mask > 0) & (seg > 0)
    lp64, old64, ref64 = (x.astype(np.float64) for x in (lp, old, ref))
    k3 = np.where(m, _k3_float64(ref64, lp64), 0.0)
    dk3 = np.where(m, 1.0 - np.exp(ref64 - lp64), 0.0)
    if level == "token":
        rho = np.where(m, np.exp(lp64 - old64), 0.0)
        want_grad = beta * rho * (k3 + dk3)
    else:
        rho, extra = np.zeros_like(lp64), np.zeros_like(lp64)
        for b in range(seg.shape[0]):
            for d in range(1, S):
                on = m[b] & (seg[b] == d)
                if not on.any():
                    continue
                rho_d = np.exp(np.mean(lp64[b, on] - old64[b, on]))
                rho[b, on] = rho_d
                extra[b, on] = rho_d * k3[b, on].sum() / on.sum()
        want_grad = beta * (rho * dk3 + extra)
    np.testing.assert_allclose(float(terms.numerator), beta * (rho * k3).sum(), rtol=1e-5)
    np.testing.assert_allclose(grad, np.where(m, want_grad, 0.0), rtol=2e-5, atol=1e-7)
    np.testing.assert_allclose(float(terms.metrics["kl"][0]), (rho * k3).sum(), rtol=1e-5)
    plain, plain_grad = terms_and_grad(lp, None if on_policy else old, ref, zero, mask, seg, ent,
                                       **kw)  # fmt: skip
    if on_policy:  # same value, gradient differs by β k3 per token (token level)
        np.testing.assert_allclose(float(plain.numerator), float(terms.numerator), rtol=1e-6)
        assert np.abs(grad - plain_grad).max() > 1e-3
