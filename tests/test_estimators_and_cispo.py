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
