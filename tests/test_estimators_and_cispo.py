"""Advantage estimators of ``grpo_advantages(..., estimator=)`` (RLOO, REINFORCE++) against
loop references in float64 (docs/algorithms/grpo.md §6), the dynamic-sampling filter, and the
config rules of the estimators and of CISPO (its numerics: tests/test_policy_loss.py)."""

import numpy as np
import pytest

from jaxrl.losses import compute_advantages, grpo_advantages


def rloo_reference(rewards: list[float], g: int) -> list[float]:
    """a_i = r_i − mean of the other scored rewards of i's group; 0 when none / unscored."""
    out = []
    for i, r in enumerate(rewards):
        group = rewards[(i // g) * g : (i // g + 1) * g]
        others = [x for j, x in enumerate(group) if j != i % g and not np.isnan(x)]
        out.append(0.0 if np.isnan(r) or not others else r - sum(others) / len(others))
    return out


def reinforce_pp_reference(rewards: list[float]) -> list[float]:
    scored = [x for x in rewards if not np.isnan(x)]
    mean = sum(scored) / len(scored)
    std = (sum((x - mean) ** 2 for x in scored) / (len(scored) - 1)) ** 0.5
    return [0.0 if np.isnan(x) else (x - mean) / (std + 1e-4) for x in rewards]


def test_rloo_worked_example():
    # rewards [1, 0, 0, 1], G = 4: each 1 sees others averaging 1/3 → +2/3; each 0 → −2/3
    adv = grpo_advantages(np.array([1.0, 0.0, 0.0, 1.0]), 4, estimator="rloo")
    np.testing.assert_allclose(adv, [2 / 3, -2 / 3, -2 / 3, 2 / 3], rtol=1e-6)


@pytest.mark.parametrize("seed", range(4))
def test_rloo_and_reinforce_pp_match_loop_references(seed):
    rng = np.random.default_rng(seed)
    g = int(rng.integers(2, 6))
    r = rng.normal(size=g * 5).round(1)
    r[rng.random(r.size) < 0.2] = np.nan  # unscorable rows
    np.testing.assert_allclose(
        grpo_advantages(r, g, estimator="rloo"), rloo_reference(list(r), g), atol=1e-6
    )
    np.testing.assert_allclose(
        grpo_advantages(r, g, estimator="reinforce_pp"),
        reinforce_pp_reference(list(r)),
        atol=1e-5,
    )


def test_rloo_of_a_group_with_one_scored_reward_is_zero():
    adv = grpo_advantages(np.array([1.0, np.nan, 5.0, 3.0]), 2, estimator="rloo")
    np.testing.assert_array_equal(adv, [0.0, 0.0, 2.0, -2.0])


def test_reinforce_pp_has_no_per_prompt_baseline():
    # two groups with different means: GRPO centres each group, REINFORCE++ the batch only
    r = np.array([1.0, 1.0, 0.0, 0.0])
    assert np.all(grpo_advantages(r, 2) == 0.0)
    adv = grpo_advantages(r, 2, estimator="reinforce_pp")
    assert adv[0] > 0 > adv[2]


def test_estimator_through_the_reward_matrix():
    x = np.array([[1.0, 0.5], [0.0, 0.5], [0.0, 0.0], [1.0, 1.0]])
    r = x @ np.array([1.0, 2.0])
    got = compute_advantages(x, 2, weights=[1.0, 2.0], estimator="rloo")
    np.testing.assert_allclose(got, rloo_reference(list(r), 2), atol=1e-6)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"estimator": "ppo"}, "advantage_estimator='ppo' is invalid"),
        ({"estimator": "rloo", "scale_rewards": "batch"}, "applies to advantage_estimator"),
        ({"estimator": "reinforce_pp", "scale_rewards": False}, "applies to advantage_estimator"),
    ],
)
def test_bad_estimator_settings_are_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        grpo_advantages(np.zeros(4), 2, **kwargs)


def test_config_names_the_estimator_and_rejects_grpo_only_settings():
    from jaxrl import ConfigError, GRPOConfig

    assert GRPOConfig(advantage_estimator="rloo").advantage_estimator == "rloo"
    with pytest.raises(ConfigError, match="advantage_estimator"):
        GRPOConfig(advantage_estimator="ppo")
    with pytest.raises(ConfigError, match="scale_rewards='none'.*GRPO's normalisation"):
        GRPOConfig(advantage_estimator="reinforce_pp", scale_rewards="none")
    with pytest.raises(ConfigError, match="multi_objective_aggregation.*sum_then_normalize"):
        GRPOConfig(advantage_estimator="rloo", multi_objective_aggregation="normalize_then_sum")


def test_cispo_config_needs_the_weight_cap():
    from jaxrl import ConfigError, GRPOConfig

    assert GRPOConfig(loss_type="cispo", epsilon_high=5.0).loss_type == "cispo"
    with pytest.raises(ConfigError, match="epsilon_high=None.*caps the importance weight"):
        GRPOConfig(loss_type="cispo")
    with pytest.raises(ConfigError, match="delta=2.0.*remove delta"):
        GRPOConfig(loss_type="cispo", epsilon_high=5.0, delta=2.0)


def test_informative_groups_drop_groups_without_a_signal():
    from jaxrl.losses.advantages import informative_groups

    x = np.array([[1.0], [1.0], [0.0], [1.0], [np.nan], [2.0], [3.0], [3.0]])
    # groups of 2: equal; differing; one scored row (σ NaN); equal
    np.testing.assert_array_equal(informative_groups(x, 2), [False, True, False, False])
    # weights count: the second function breaks the tie of group 0
    x2 = np.array([[1.0, 0.0], [1.0, 1.0]])
    assert informative_groups(x2, 2, weights=[1.0, 0.5]).tolist() == [True]
    assert informative_groups(x2, 2, weights=[1.0, 0.0]).tolist() == [False]


def kl_in_reward_reference(rewards, old, ref, masks, beta):
    """Per token t of row i: G_t = r_i − β Σ_{s ≥ t, s in the loss} (old_s − ref_s), whitened
    over every loss token (Bessel std + 1e-4); 0 outside the loss."""
    returns = []
    for r, o, f, m in zip(rewards, old, ref, masks, strict=True):
        row = []
        for t in range(len(o)):
            to_go = sum(o[s] - f[s] for s in range(t, len(o)) if m[s])
            row.append(r - beta * to_go if m[t] else None)
        returns.append(row)
    flat = [g for row in returns for g in row if g is not None]
    mean = sum(flat) / len(flat)
    std = (sum((g - mean) ** 2 for g in flat) / (len(flat) - 1)) ** 0.5
    return [[0.0 if g is None else (g - mean) / (std + 1e-4) for g in row] for row in returns]


def test_kl_in_reward_worked_example_and_reference():
    """rewards [1, 0], β = 0.1, k1 KL per token [0.2, 0.1] and [0.3]: returns to go
    [1 − 0.03, 1 − 0.01] and [−0.03], whitened over the three tokens."""
    from jaxrl.losses.advantages import kl_in_reward_advantages

    old = [np.array([-0.5, -0.7]), np.array([-0.2])]
    ref = [np.array([-0.7, -0.8]), np.array([-0.5])]
    masks = [np.ones(2), np.ones(1)]
    adv = kl_in_reward_advantages(np.array([1.0, 0.0]), old, ref, masks, 0.1)
    g = np.array([0.97, 0.99, -0.03])
    want = (g - g.mean()) / (g.std(ddof=1) + 1e-4)
    np.testing.assert_allclose(np.concatenate(adv), want, atol=1e-6)
    rng = np.random.default_rng(0)
    lengths = [3, 1, 4, 2, 5]
    old = [rng.normal(-1, 0.3, n) for n in lengths]
    ref = [rng.normal(-1, 0.3, n) for n in lengths]
    masks = [rng.random(n) > 0.3 for n in lengths]
    rewards = np.array([1.0, 0.0, np.nan, 0.5, 2.0])  # row 2 unscorable: zeros
    got = kl_in_reward_advantages(rewards, old, ref, masks, 0.05)
    want = kl_in_reward_reference(
        [0.0 if np.isnan(r) else r for r in rewards], old, ref, [m & (i != 2) for i, m in
        enumerate(masks)], 0.05,
    )  # fmt: skip
    for a, w, m in zip(got, want, masks, strict=True):
        assert a.dtype == np.float32
        np.testing.assert_allclose(a, w, atol=1e-5)
        assert np.all(a[~m] == 0)
    assert np.all(got[2] == 0)


def test_kl_in_reward_config_rules():
    from jaxrl.config import ConfigError, GRPOConfig

    ok = GRPOConfig(advantage_estimator="reinforce_pp", kl_in_reward=True, beta=0.01)
    assert ok.kl_in_reward
    with pytest.raises(ConfigError, match=r"^kl_in_reward=True is invalid.*reinforce_pp"):
        GRPOConfig(kl_in_reward=True, beta=0.01)
    with pytest.raises(ConfigError, match=r"^kl_in_reward=True is invalid.*beta > 0"):
        GRPOConfig(advantage_estimator="reinforce_pp", kl_in_reward=True)
