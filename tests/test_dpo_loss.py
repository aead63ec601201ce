"""DPO variants, sequence log-probs, packed pairs and step normalisation
(docs/algorithms/dpo.md §3–5, §8)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxrl.losses.dpo import (
    LOSS_TYPES,
    dpo_loss,
    dpo_loss_terms,
    dpo_metrics,
    dpo_rewards,
    pair_documents,
    pair_mask,
    pair_tokens,
    sequence_logps,
    target_mask,
    uses_mean_logps,
    wpo_weights,
)

IGNORE = -100
METRIC_KEYS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracy",
    "rewards/margin",
    "logps/chosen",
    "logps/rejected",
)


# ----------------------------------------------------------------- float64 references


def logsig(x):
    return -np.logaddexp(0.0, -x)


def ref_loss(pc, pr, rc, rr, *, beta, loss_type, eps=0.0, gamma=0.3, w=None):
    pc, pr, rc, rr = (np.asarray(x, np.float64) for x in (pc, pr, rc, rr))
    smooth = lambda x: -(1 - eps) * logsig(x) - eps * logsig(-x)
    if loss_type == "simpo":
        return smooth(beta * ((pc - pr) - gamma))
    if loss_type == "orpo":  # the odds-ratio term (the NLL: tests/test_orpo.py)
        return -beta * logsig((pc - pr) - (np.log1p(-np.exp(pc)) - np.log1p(-np.exp(pr))))
    z = (pc - pr) - (rc - rr)
    if loss_type in ("sigmoid", "dpo", "sigmoid_norm", "dpo_norm"):
        return smooth(beta * z)
    if loss_type == "ipo":
        return (z - 1 / (2 * beta)) ** 2
    if loss_type == "hinge":
        return np.maximum(0.0, 1 - beta * z)
    if loss_type == "robust":
        return (-(1 - eps) * logsig(beta * z) + eps * logsig(-beta * z)) / (1 - 2 * eps)
    assert loss_type == "wpo"
    return np.asarray(w, np.float64) * smooth(beta * z)


def pack_pairs(rows, T):
    """rows: list of rows, each a list of pairs ((len_c, prompt_c), (len_r, prompt_r)).
    Returns segment ids and labels (IGNORE on prompt tokens and padding)."""
    seg = np.zeros((len(rows), T), np.int32)
    labels = np.full((len(rows), T), IGNORE, np.int64)
    for b, pairs in enumerate(rows):
        t, d = 0, 0
        for pair in pairs:
            for length, prompt in pair:
                d += 1
                seg[b, t : t + length] = d
                labels[b, t + prompt : t + length] = 7
                t += length
        assert t <= T
    return seg, labels


def loop_documents(lp, labels, seg):
    """Per (row, doc): (sum, count, length) with position t scoring label t+1 of the same doc."""
    out = {}
    for b in range(seg.shape[0]):
        for d in sorted(set(seg[b].tolist()) - {0}):
            pos = np.nonzero(seg[b] == d)[0]
            scored = [t for t in pos[:-1] if labels[b, t + 1] != IGNORE]
            out[b, d] = (float(np.sum(lp[b, scored], dtype=np.float64)), len(scored), len(pos))
    return out


# ----------------------------------------------------------------- examples 22–24


def test_example_22_sigmoid_values_and_smoothing():
    args = [jnp.float32(x) for x in (0.0, -5.0, -1.0, -1.0)]
    assert float(dpo_loss(*args, beta=0.1)) == pytest.approx(0.47408, abs=1e-5)
    swapped = [args[1], args[0], args[2], args[3]]
    assert float(dpo_loss(*swapped, beta=0.1)) == pytest.approx(0.97408, abs=1e-5)
    cdpo = float(dpo_loss(*args, beta=0.1, label_smoothing=0.1))
    assert cdpo == pytest.approx(0.52408, abs=1e-5)
    assert cdpo == pytest.approx(0.9 * 0.474077 + 0.1 * 0.974077, abs=1e-5)
    assert float(dpo_loss(*args, beta=0.1, loss_type="dpo")) == float(dpo_loss(*args, beta=0.1))


def test_example_22_rewards_carry_no_gradient():
    def total(pc, pr):
        rc, rr = dpo_rewards(pc, pr, jnp.float32(-1.0), jnp.float32(-1.0), beta=0.1)
        return rc + rr

    grads = jax.grad(total, argnums=(0, 1))(jnp.float32(0.0), jnp.float32(-5.0))
    assert [float(g) for g in grads] == [0.0, 0.0]
    rc, rr = dpo_rewards(jnp.float32(0.0), jnp.float32(-5.0), jnp.float32(-1.0), jnp.float32(-1.0))
    assert (float(rc), float(rr)) == pytest.approx((0.1, -0.4))


def test_example_23_simpo():
    loss = dpo_loss(
        jnp.float32(0.0),
        jnp.float32(-1.0),
        None,
        None,
        beta=0.1,
        loss_type="simpo",
        simpo_gamma=0.3,
    )
    assert float(loss) == pytest.approx(0.65876, abs=1e-5)
    assert float(loss) == pytest.approx(-logsig(0.07), rel=1e-6)
    other = dpo_loss(
        jnp.float32(0.0),
        jnp.float32(-1.0),
        None,
        None,
        beta=0.1,
        loss_type="simpo",
        simpo_gamma=0.5,
    )
    assert float(other) > float(loss)
    rc, rr = dpo_rewards(jnp.float32(0.0), jnp.float32(-1.0), None, None, loss_type="simpo")
    assert (float(rc), float(rr)) == pytest.approx((0.0, -0.1))


def test_example_24_average_logprob():
    lp = jnp.array([[-1.0, -2.0, -3.0, -4.0]])
    labels = jnp.array([[0, 1, 2, IGNORE]])
    seg = jnp.ones((1, 4), jnp.int32)
    mask = target_mask(labels, seg)
    np.testing.assert_array_equal(mask, [[True, True, False, False]])
    assert float(sequence_logps(lp, mask, seg, 2, mean=True)[0, 1]) == -1.5
    assert float(sequence_logps(lp, mask, seg, 2, mean=False)[0, 1]) == -3.0
    none = target_mask(jnp.full((1, 4), IGNORE), seg)
    out = sequence_logps(lp, none, seg, 2, mean=True)
    assert float(out[0, 1]) == 0.0 and np.all(np.isfinite(out))


# ----------------------------------------------------------------- variants vs reference


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_variants_match_float64_reference(loss_type):
    rng = np.random.default_rng(len(loss_type))
    pc, pr, rc, rr = (rng.normal(size=16).astype(np.float32) * 3 - 10 for _ in range(4))
    eps = 0.15 if loss_type in ("sigmoid", "sigmoid_norm", "robust", "simpo", "wpo") else 0.0
    if loss_type == "orpo":  # per-token means of log-probs: < 0
        pc, pr = -np.abs(pc) / 10, -np.abs(pr) / 10
    w = wpo_weights(jnp.asarray(pc) / 20, jnp.asarray(pr) / 20)
    got = dpo_loss(
        pc,
        pr,
        rc,
        rr,
        beta=0.3,
        loss_type=loss_type,
        label_smoothing=eps,
        simpo_gamma=0.4,
        weights=w,
    )
    want = ref_loss(pc, pr, rc, rr, beta=0.3, loss_type=loss_type, eps=eps, gamma=0.4, w=w)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6)


def test_wpo_weights_are_constants():
    a_c, a_r = jnp.float32(-0.2), jnp.float32(-0.5)
    w = wpo_weights(a_c, a_r)
    assert float(w) == pytest.approx(math.exp(-0.7))
    assert float(wpo_weights(jnp.float32(0.3), jnp.float32(0.2))) == 1.0  # min(1, ·)
    assert float(jax.grad(lambda x: wpo_weights(x, a_r))(a_c)) == 0.0
    args = [jnp.float32(x) for x in (-3.0, -4.0, -3.5, -3.5)]
    g_w = jax.grad(lambda ww: dpo_loss(*args, loss_type="wpo", weights=ww))(w)
    assert float(g_w) == 0.0  # w is treated as a constant
    g_pc = jax.grad(lambda pc: dpo_loss(pc, *args[1:], loss_type="wpo", weights=w))(args[0])
    g_sig = jax.grad(lambda pc: dpo_loss(pc, *args[1:]))(args[0])
    assert float(g_pc) == pytest.approx(float(w) * float(g_sig), rel=1e-6)


def test_argument_errors():
    x = jnp.zeros(3)
    with pytest.raises(ValueError, match="loss_type='kto'"):
        dpo_loss(x, x, x, x, loss_type="kto")
    for eps in (0.5, -0.1):
        with pytest.raises(ValueError, match=r"label_smoothing.*\[0, 0.5\)"):
            dpo_loss(x, x, x, x, label_smoothing=eps)
    for lt in ("ipo", "hinge"):
        with pytest.raises(ValueError, match=f"loss_type='{lt}'"):
            dpo_loss(x, x, x, x, loss_type=lt, label_smoothing=0.1)
    with pytest.raises(ValueError, match="needs weights"):
        dpo_loss(x, x, x, x, loss_type="wpo")
    with pytest.raises(ValueError, match="needs ref_chosen"):
        dpo_loss(x, x, None, None)
    assert dpo_loss(x, x, None, None, loss_type="simpo").shape == (3,)


# ----------------------------------------------------------------- packing helpers

ROWS = [
    [((7, 3), (5, 3)), ((9, 2), (4, 2))],
    [((12, 4), (6, 4))],
    [],  # bucket padding: an empty row
]


def test_target_mask_and_sequence_logps_match_loop():
    seg, labels = pack_pairs(ROWS, 40)
    lp = np.random.default_rng(0).normal(size=seg.shape).astype(np.float32) - 2
    mask = target_mask(jnp.asarray(labels), jnp.asarray(seg))
    sums = sequence_logps(lp, mask, seg, 6, mean=False)
    means = sequence_logps(lp, mask, seg, 6, mean=True)
    docs = loop_documents(lp, labels, seg)
    for (b, d), (s, n, _) in docs.items():
        assert float(sums[b, d]) == pytest.approx(s, rel=1e-6)
        assert float(means[b, d]) == pytest.approx(s / max(n, 1), rel=1e-6)
    assert sum(n for _, n, _ in docs.values()) == int(np.sum(mask))  # no cross-document scoring
    listed = set(docs)
    for b in range(3):
        for d in range(6):
            if (b, d) not in listed:
                assert float(sums[b, d]) == 0.0 and float(means[b, d]) == 0.0


def test_target_mask_never_scores_across_documents():
    labels = jnp.array([[IGNORE, 5, 6, 7, 8, 9, IGNORE]])  # document 2 starts with a label
    seg = jnp.array([[1, 1, 1, 2, 2, 2, 0]])
    np.testing.assert_array_equal(target_mask(labels, seg), [[1, 1, 0, 1, 1, 0, 0]])


def test_pair_mapping():
    seg, _ = pack_pairs(ROWS, 40)
    seg = seg.copy()
    seg[1, 30:33] = 3  # a lone chosen document without its rejected partner
    valid = pair_mask(jnp.asarray(seg), 6)
    np.testing.assert_array_equal(valid, [[True, True], [True, False], [False, False]])
    np.testing.assert_array_equal(pair_tokens(jnp.asarray(seg), 6)[:2], [[12, 13], [18, 3]])
    x = jnp.arange(12.0).reshape(2, 6)
    c, r = pair_documents(x)
    np.testing.assert_array_equal(c, [[1, 3], [7, 9]])
    np.testing.assert_array_equal(r, [[2, 4], [8, 10]])


# ----------------------------------------------------------------- micro-batch terms


def _packed_case(seed=0, rows=ROWS, T=40):
    seg, labels = pack_pairs(rows, T)
    rng = np.random.default_rng(seed)
    lp = (rng.normal(size=seg.shape) * 0.5 - 2).astype(np.float32)
    ref_c = (rng.normal(size=(len(rows), 2)) * 2 - 20).astype(np.float32)
    ref_r = (rng.normal(size=(len(rows), 2)) * 2 - 20).astype(np.float32)
    return seg, labels, lp, ref_c, ref_r


@pytest.mark.parametrize("normalize", ["pair", "token"])
@pytest.mark.parametrize("loss_type", [t for t in LOSS_TYPES if t != "orpo"])  # test_orpo.py
def test_dpo_loss_terms_match_loop_reference(loss_type, normalize):
    seg, labels, lp, ref_c, ref_r = _packed_case(seed=3)
    mean = uses_mean_logps(loss_type)
    eps = 0.1 if loss_type not in ("ipo", "hinge") else 0.0
    if mean:  # reference values in the loss's aggregation (per-token means are ~ -2)
        ref_c, ref_r = ref_c / 10, ref_r / 10
    mask = target_mask(jnp.asarray(labels), jnp.asarray(seg))
    kw = dict(
        num_segments=6,
        beta=0.2,
        loss_type=loss_type,
        label_smoothing=eps,
        simpo_gamma=0.25,
        normalize=normalize,
    )
    terms = dpo_loss_terms(lp, mask, seg, ref_c, ref_r, **kw)

    docs = loop_documents(lp, labels, seg)
    num = den = 0.0
    sums = dict.fromkeys(METRIC_KEYS, 0.0)
    n_pairs = 0
    for (b, d), (s_c, n_c, len_c) in docs.items():
        if d % 2 == 0:
            continue
        s_r, n_r, len_r = docs[b, d + 1]
        p = (d - 1) // 2
        v_c, v_r = (s_c / max(n_c, 1), s_r / max(n_r, 1)) if mean else (s_c, s_r)
        w = min(1.0, math.exp(s_c / max(n_c, 1) + s_r / max(n_r, 1)))
        loss = ref_loss(
            v_c,
            v_r,
            ref_c[b, p],
            ref_r[b, p],
            beta=0.2,
            loss_type=loss_type,
            eps=eps,
            gamma=0.25,
            w=w,
        )
        weight = 1.0 if normalize == "pair" else len_c + len_r
        num, den, n_pairs = num + weight * loss, den + weight, n_pairs + 1
        if loss_type == "simpo":
            r_c, r_r = 0.2 * v_c, 0.2 * v_r
        else:
            r_c, r_r = 0.2 * (v_c - ref_c[b, p]), 0.2 * (v_r - ref_r[b, p])
        for key, val in zip(
            METRIC_KEYS, (r_c, r_r, float(r_c > r_r), r_c - r_r, v_c, v_r), strict=True
        ):
            sums[key] += val
    assert n_pairs == 3
    np.testing.assert_allclose(float(terms.numerator), num, rtol=1e-5)
    assert float(terms.denominator) == den
    for key in METRIC_KEYS:
        np.testing.assert_allclose(float(terms.metrics[key][0]), sums[key], rtol=1e-5, atol=1e-6)
        assert float(terms.metrics[key][1]) == 3.0


def test_step_zero_policy_equals_reference():
    """At step 0 the policy values equal the reference: rewards 0, loss log 2, accuracy 0."""
    seg, labels, lp, _, _ = _packed_case(seed=1)
    mask = target_mask(jnp.asarray(labels), jnp.asarray(seg))
    seq = sequence_logps(lp, mask, seg, 6, mean=False)
    ref_c, ref_r = pair_documents(seq)
    t = dpo_loss_terms(lp, mask, seg, ref_c, ref_r, num_segments=6)
    np.testing.assert_allclose(float(t.numerator / t.denominator), math.log(2), rtol=1e-6)
    assert float(t.metrics["rewards/accuracy"][0]) == 0.0  # ties count as wrong
    assert float(t.metrics["rewards/margin"][0]) == 0.0


def test_padding_and_empty_slots_change_nothing():
    seg, labels, lp, ref_c, ref_r = _packed_case(seed=2, rows=ROWS[:1], T=25)
    mask = target_mask(jnp.asarray(labels), jnp.asarray(seg))
    kw = dict(num_segments=6, loss_type="sigmoid", normalize="token")
    t = dpo_loss_terms(lp, mask, seg, ref_c, ref_r, **kw)
    padded = lambda x, v: np.concatenate([x, np.full((1, 15), v, x.dtype)], axis=1)
    t_pad = dpo_loss_terms(
        padded(lp, np.nan), padded(np.asarray(mask), True), padded(seg, 0), ref_c, ref_r, **kw
    )
    for a, b in zip(jax.tree.leaves(t), jax.tree.leaves(t_pad), strict=True):
        np.testing.assert_array_equal(a, b)
    # An empty row with garbage reference values contributes exactly nothing.
    empty = dpo_loss_terms(lp, mask, np.zeros_like(seg), ref_c * np.nan, ref_r, **kw)
    assert all(float(x) == 0.0 for x in jax.tree.leaves(empty))


# ----------------------------------------------------------------- examples 26–28

A_ROW = [((50, 10), (50, 10))]  # T_p = 100
B_ROW = [((150, 10), (150, 10))]  # T_p = 300


def _hinge_batch(rows, T):
    """Hinge loss (β = 0.1, refs 0): pair in A_ROW has loss 1.0, in B_ROW loss 3.0 (z = −20)."""
    seg, labels = pack_pairs(rows, T)
    mask = np.asarray(target_mask(jnp.asarray(labels), jnp.asarray(seg)))
    lp = np.zeros(seg.shape, np.float32)
    for b, pairs in enumerate(rows):
        if pairs == B_ROW:
            chosen = mask[b] & (seg[b] == 1)
            lp[b, chosen] = -20.0 / chosen.sum()
    zeros = np.zeros((len(rows), 1), np.float32)
    return lp, mask, seg, zeros, zeros


def _sum_terms(batches, normalize):
    terms = [
        dpo_loss_terms(*b, num_segments=3, beta=0.1, loss_type="hinge", normalize=normalize)
        for b in batches
    ]
    num = sum(t.numerator for t in terms)
    den = sum(t.denominator for t in terms)
    metrics = jax.tree.map(lambda *xs: sum(xs), *[t.metrics for t in terms])
    return num, den, metrics


@pytest.mark.slow
@pytest.mark.parametrize("normalize,expected", [("pair", 2.0), ("token", 2.5)])
def test_example_26_token_weighting_one_rank(normalize, expected):
    two = [_hinge_batch([A_ROW], 100), _hinge_batch([B_ROW], 300)]
    num, den, _ = _sum_terms(two, normalize)
    np.testing.assert_allclose(float(num / den), expected, rtol=1e-5)
    # Same pairs in one micro-batch (two rows): identical.
    lp_a, m_a, s_a, _, _ = two[0]
    lp_b, m_b, s_b, z, _ = two[1]
    pad = lambda x: np.concatenate([x, np.zeros((1, 200), x.dtype)], axis=1)
    one = (
        np.concatenate([pad(lp_a), lp_b]),
        np.concatenate([pad(m_a), m_b]),
        np.concatenate([pad(s_a), s_b]),
        np.zeros((2, 1), np.float32),
        np.zeros((2, 1), np.float32),
    )
    num1, den1, _ = _sum_terms([one], normalize)
    np.testing.assert_allclose(float(num1 / den1), expected, rtol=1e-5)

    # Gradient: ∇ of the stated objective. Hinge: ∂ℓ/∂lp = −β on chosen, +β on rejected tokens.
    def loss(lps):
        batches = [(lp, *rest) for lp, (_, *rest) in zip(lps, two, strict=True)]
        num, den, _ = _sum_terms(batches, normalize)
        return num / den

    grads = jax.grad(loss)([jnp.asarray(b[0]) for b in two])
    total_tokens = 400.0
    for (_, mask, seg, _, _), g, t_p in zip(two, grads, (100.0, 300.0), strict=True):
        weight = 0.5 if normalize == "pair" else t_p / total_tokens
        sign = np.where(seg == 1, -1.0, 1.0)
        np.testing.assert_allclose(g, weight * 0.1 * sign * mask, rtol=1e-6, atol=1e-9)
    if normalize == "token":  # differs from the gradient of the plain pair mean
        assert not np.allclose(grads[0], 0.5 * 0.1 * np.where(two[0][2] == 1, -1, 1) * two[0][1])


@pytest.mark.parametrize("normalize,expected", [("pair", 2.0), ("token", 2.5)])
def test_example_27_two_ranks_shard_map(normalize, expected):
    """Rank 0 holds the 100-token pair, rank 1 the 300-token pair; psum then one division."""
    a, b = _hinge_batch([A_ROW], 300), _hinge_batch([B_ROW], 300)
    stacked = [np.stack([x, y]) for x, y in zip(a, b, strict=True)]  # [R=2, 1, ...]
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))

    def per_rank(lp, mask, seg, rc, rr):
        t = dpo_loss_terms(
            lp[0],
            mask[0],
            seg[0],
            rc[0],
            rr[0],
            num_segments=3,
            beta=0.1,
            loss_type="hinge",
            normalize=normalize,
        )
        return jax.lax.psum((t.numerator, t.denominator, t.metrics), "data")

    f = jax.shard_map(per_rank, mesh=mesh, in_specs=P("data"), out_specs=P())
    num, den, metrics = jax.jit(f)(*stacked)
    np.testing.assert_allclose(float(num / den), expected, rtol=1e-5)
    num1, den1, _ = _sum_terms([a, b], normalize)  # one rank, two micro-batches
    np.testing.assert_allclose(float(num / den), float(num1 / den1), rtol=1e-6)
    assert float(metrics["rewards/accuracy"][1]) == 2.0


@pytest.mark.parametrize("normalize", ["pair", "token"])
def test_example_28_metrics_are_pair_means(normalize):
    """Accuracy 1.0 on the 100-token pair, 0.0 on the 300-token pair → 0.5 (not 0.25)."""
    a = list(_hinge_batch([A_ROW], 100))
    a[0] = np.where(a[2] == 1, a[0] + 0.01 * a[1], a[0]).astype(np.float32)  # r_c > r_r
    b = _hinge_batch([B_ROW], 300)  # r_c < r_r
    _, _, metrics = _sum_terms([tuple(a), b], normalize)
    mean = {k: float(s / c) for k, (s, c) in metrics.items()}
    assert mean["rewards/accuracy"] == 0.5
    assert mean["rewards/margin"] == pytest.approx(
        mean["rewards/chosen"] - mean["rewards/rejected"], abs=1e-6
    )
    np.testing.assert_allclose(mean["rewards/chosen"], (0.1 * 0.4 + 0.1 * -20) / 2, rtol=1e-5)
    np.testing.assert_allclose(mean["logps/chosen"], (0.4 - 20) / 2, rtol=1e-5)


def test_metrics_without_mask_count_every_pair():
    m = dpo_metrics(
        jnp.array([0.0, -1.0]), jnp.array([-1.0, 0.0]), jnp.zeros(2), jnp.zeros(2), beta=1.0
    )
    assert [float(x) for x in m["rewards/accuracy"]] == [1.0, 2.0]


def test_accuracy_counts_a_margin_only_above_the_tolerance():
    """rewards/accuracy: z ≤ MARGIN_TOLERANCE per loss token is a tie (the fp32 noise between
    the reference cache and the step's forward at step 1); above it, a win. Two pairs of one row:
    pair 1 has 3 + 2 loss tokens (tolerance 5e-5 in sums, 2e-5 in means), pair 2 likewise."""
    from jaxrl.losses.dpo import MARGIN_TOLERANCE, margin_tolerance

    seg = jnp.asarray([[1, 1, 1, 1, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 0]], jnp.int32)
    labels = jnp.asarray([[IGNORE, 5, 5, 5, IGNORE, 5, 5, IGNORE, 5, 5, 5, IGNORE, 5, 5, IGNORE]])
    mask = target_mask(labels, seg).astype(jnp.float32)
    tol_sum = np.asarray(margin_tolerance(mask, seg, 5, mean=False))
    tol_mean = np.asarray(margin_tolerance(mask, seg, 5, mean=True))
    np.testing.assert_allclose(tol_sum, [[5 * MARGIN_TOLERANCE, 5 * MARGIN_TOLERANCE]])
    np.testing.assert_allclose(tol_mean, [[2 * MARGIN_TOLERANCE, 2 * MARGIN_TOLERANCE]])
    z = jnp.asarray([[1e-7, 1e-3]])  # noise, and a real margin
    m = dpo_metrics(z, jnp.zeros((1, 2)), jnp.zeros((1, 2)), jnp.zeros((1, 2)), beta=0.1,
                    tolerance=jnp.asarray(tol_sum))  # fmt: skip
    assert [float(x) for x in m["rewards/accuracy"]] == [1.0, 2.0]
    # through the loss terms: policy = reference (z = 0 up to noise) → accuracy exactly 0
    rng = np.random.default_rng(0)
    logp = jnp.asarray(-rng.uniform(0.1, 3.0, size=seg.shape), jnp.float32)
    seq = sequence_logps(logp, mask, seg, 5, mean=False)
    ref_c, ref_r = pair_documents(seq)
    noisy_c = ref_c + jnp.asarray([[-2e-7, 0.0]])  # the cache rounded the other way
    terms = dpo_loss_terms(logp, mask, seg, noisy_c, ref_r, num_segments=5, beta=0.1)
    assert float(terms.metrics["rewards/accuracy"][0]) == 0.0
    assert float(terms.metrics["rewards/margin"][0]) > 0.0  # the noise is there, just not a win
