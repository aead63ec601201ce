"""GRPO rewards, advantages and generation-side metrics (docs/algorithms/grpo.md §6, §9;
§10 examples 13–14)."""

import math
import statistics

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl.losses.advantages import (
    aggregate_rewards,
    compute_advantages,
    grpo_advantages,
    nanstd,
    reward_metrics,
)

NAN = float("nan")


# ----------------------------------------------------------------- independent references


def ref_std(values):
    vals = [float(v) for v in values if not math.isnan(v)]
    return statistics.stdev(vals) if len(vals) >= 2 else NAN


def ref_mean(values):
    vals = [float(v) for v in values if not math.isnan(v)]
    return statistics.fmean(vals) if vals else NAN


def ref_advantages(rewards, g, scale):
    """Loop reference of §6 sum_then_normalize in float64."""
    rewards = [float(r) for r in rewards]
    std_all = ref_std(rewards)
    out = []
    for k in range(0, len(rewards), g):
        grp = rewards[k : k + g]
        mean, std = ref_mean(grp), ref_std(grp)
        for r in grp:
            a = r - mean
            if scale == "group":
                a = a / (std + 1e-4)
            elif scale == "batch":
                a = a / (std_all + 1e-4)
            out.append(0.0 if math.isnan(a) else a)
    return np.array(out)


def ref_weighted_sum(row, weights):
    if all(math.isnan(v) for v in row):
        return NAN
    return sum(w * v for w, v in zip(weights, row, strict=True) if not math.isnan(v))


# ----------------------------------------------------------------- example 13


def test_example_13_group_scaling():
    adv = grpo_advantages(np.array([1, 0, 0, 1, 2, 2, 2, 2.0]), 4)
    a = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    assert a == pytest.approx(0.86588, abs=1e-5)
    np.testing.assert_allclose(adv, [a, -a, -a, a, 0, 0, 0, 0], rtol=1e-6)
    assert adv.dtype == np.float32


def test_example_13_none_scaling_and_booleans():
    rewards = np.array([1, 0, 0, 1, 2, 2, 2, 2.0])
    np.testing.assert_array_equal(
        grpo_advantages(rewards, 4, "none"), [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]
    )
    np.testing.assert_array_equal(
        grpo_advantages(rewards, 4, False), grpo_advantages(rewards, 4, "none")
    )
    np.testing.assert_array_equal(
        grpo_advantages(rewards, 4, True), grpo_advantages(rewards, 4, "group")
    )


def test_example_13_frac_reward_zero_std():
    m = reward_metrics(np.array([[1, 0, 0, 1, 2, 2, 2, 2.0]]).T, 4)
    assert m["frac_reward_zero_std"] == 0.5
    assert m["reward"] == pytest.approx(1.25)
    assert m["reward_std"] == pytest.approx(ref_std([1, 0, 0, 1, 2, 2, 2, 2]))


# ----------------------------------------------------------------- example 14


def test_example_14_nanstd():
    assert nanstd(np.array([1, 2, 3, NAN])) == pytest.approx(1.0)
    row = nanstd(np.array([[1, NAN], [3, 5]]), axis=1)
    assert math.isnan(row[0]) and row[1] == pytest.approx(1.41421, abs=1e-5)
    assert math.isnan(nanstd(np.array([NAN, NAN, NAN])))
    assert math.isnan(nanstd(np.array([4.0])))


def test_example_14_unscorable_row_gets_zero_advantage():
    # Row 1 is unscorable (all reward functions returned None): advantage 0; the rest of its
    # group is normalised over the 3 scored rows only.
    matrix = np.array([[1.0, 0.0], [NAN, NAN], [0.0, NAN], [2.0, 1.0]])
    adv = compute_advantages(matrix, 4, weights=[1.0, 2.0])
    sums = [1.0, NAN, 0.0, 4.0]
    assert adv[1] == 0.0
    np.testing.assert_allclose(adv, ref_advantages(sums, 4, "group"), rtol=1e-6)
    assert np.all(np.isfinite(adv))


# ----------------------------------------------------------------- API contract


def test_length_must_be_multiple_of_group():
    with pytest.raises(ValueError, match="not a multiple of num_generations=4"):
        grpo_advantages(np.zeros(6), 4)


def test_bad_scale_rewards():
    with pytest.raises(ValueError, match="scale_rewards"):
        grpo_advantages(np.zeros(4), 2, "mean")


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_match_loop_reference(scale):
    rng = np.random.default_rng(0)
    rewards = rng.normal(size=24)
    rewards[[3, 10, 11]] = NAN
    rewards[16:20] = 7.0  # a zero-std group
    adv = grpo_advantages(rewards, 4, scale)
    np.testing.assert_allclose(adv, ref_advantages(rewards, 4, scale), rtol=1e-6, atol=1e-7)


@settings(max_examples=40, deadline=None)
@given(
    st.integers(2, 5),
    st.integers(1, 4),
    st.sampled_from(["group", "batch", "none"]),
    st.data(),
)
def test_advantages_property(g, groups, scale, data):
    vals = data.draw(
        st.lists(
            st.one_of(st.floats(-10, 10), st.just(NAN)), min_size=g * groups, max_size=g * groups
        )
    )
    adv = grpo_advantages(np.array(vals), g, scale)
    assert adv.dtype == np.float32 and np.all(np.isfinite(adv))
    np.testing.assert_allclose(adv, ref_advantages(vals, g, scale), rtol=1e-5, atol=1e-4)


# ----------------------------------------------------------------- aggregation


def test_sum_then_normalize_weights_and_nan():
    matrix = np.array([[1.0, 2.0], [NAN, 3.0], [NAN, NAN], [0.5, -1.0]])
    got = aggregate_rewards(matrix, [0.5, 2.0])
    want = [ref_weighted_sum(r, [0.5, 2.0]) for r in matrix]
    np.testing.assert_allclose(got, want)  # NaN positions must agree too
    with pytest.raises(ValueError, match="one weight per function"):
        aggregate_rewards(matrix, [1.0])


def test_normalize_then_sum_matches_reference():
    rng = np.random.default_rng(1)
    matrix = rng.normal(size=(8, 3))
    matrix[2, 1] = NAN
    matrix[5, :] = NAN
    w = [1.0, 0.5, 2.0]
    g = 4
    z = np.full_like(matrix, NAN)
    for k in range(3):
        for s in range(0, 8, g):
            col = matrix[s : s + g, k]
            z[s : s + g, k] = (col - ref_mean(col)) / (ref_std(col) + 1e-4)
    r = np.array([ref_weighted_sum(row, w) for row in z])
    r[5] = NAN  # unscorable
    np.testing.assert_allclose(
        aggregate_rewards(matrix, w, "normalize_then_sum", num_generations=g), r
    )
    want = (r - ref_mean(r)) / (ref_std(r) + 1e-4)
    want = np.nan_to_num(want, nan=0.0)
    got = compute_advantages(matrix, g, weights=w, mode="normalize_then_sum")
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert got[5] == 0.0
    with pytest.raises(ValueError, match="needs num_generations"):
        aggregate_rewards(matrix, w, "normalize_then_sum")
    with pytest.raises(ValueError, match="multi_objective_aggregation"):
        aggregate_rewards(matrix, w, "mean")


# ----------------------------------------------------------------- metrics (§9)


def test_metrics_group_batch_and_per_function():
    matrix = np.array([[1, 0], [1, 1], [0, NAN], [1, 2], [NAN, NAN], [3, 3], [3, 3], [3, 3.0]])
    sums = np.array([ref_weighted_sum(r, [1, 1]) for r in matrix])
    m = reward_metrics(matrix, 4, reward_names=["acc", "fmt"])
    assert m["reward"] == pytest.approx(ref_mean(sums))
    assert m["reward_std"] == pytest.approx(ref_std(sums))
    # group 1: sums [1, 2, 0, 3] std > 0; group 2: [NaN, 6, 6, 6] std 0 → 4 of 8 rows
    assert m["frac_reward_zero_std"] == 0.5
    assert m["rewards/acc/mean"] == pytest.approx(ref_mean(matrix[:, 0]))
    assert m["rewards/fmt/std"] == pytest.approx(ref_std(matrix[:, 1]))
    # batch scaling: σ is the batch std (> 0) for every row
    assert reward_metrics(matrix, 4, scale_rewards="batch")["frac_reward_zero_std"] == 0.0
    # normalize_then_sum: batch std of the z-sums; a constant batch has σ = 0 for all rows
    const = np.ones((8, 2))
    assert reward_metrics(const, 4, mode="normalize_then_sum")["frac_reward_zero_std"] == 1.0


def test_metrics_nan_sigma_does_not_count():
    # A group with one scored row has NaN σ, which is not "zero std".
    matrix = np.array([[1.0], [NAN], [NAN], [NAN]])
    assert reward_metrics(matrix, 4)["frac_reward_zero_std"] == 0.0


def test_metrics_pool_rows_over_generation_batches():
    a = np.array([[1.0], [1.0], [0.0], [2.0]])  # groups of 2: σ 0 and σ > 0
    b = np.array([[5.0], [5.0], [5.0], [5.0], [1.0], [2.0], [3.0], [4.0]])  # σ 0, 0, >0, >0
    m = reward_metrics([a, b], 2)
    pooled = np.concatenate([a[:, 0], b[:, 0]])
    assert m["reward"] == pytest.approx(ref_mean(pooled))
    assert m["reward_std"] == pytest.approx(ref_std(pooled))
    assert m["frac_reward_zero_std"] == pytest.approx(6 / 12)  # row-weighted: (2 + 4) / 12
