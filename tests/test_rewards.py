"""Reward functions: built-ins, None → NaN, weights through the advantages, clear errors."""

from __future__ import annotations

import numpy as np
import pytest

from jaxrl.config import ConfigError
from jaxrl.losses.advantages import compute_advantages, reward_metrics
from jaxrl.rollout.rewards.builtin import exact_answer_reward, format_reward
from jaxrl.rollout.rewards.compute import reward_name, score_completions
from jaxrl.rollout.rewards.specs import resolve_reward_funcs

PROMPTS = ["12+39=", "12+39=", "05+05=", "05+05="]
COMPLETIONS = ["15", " 15 ", "01", "x1"]
ANSWERS = ["15", "15", "01", "01"]


def test_builtins_score_exact_answer_and_format():
    assert exact_answer_reward(PROMPTS, COMPLETIONS, answer=ANSWERS) == [1.0, 1.0, 1.0, 0.0]
    assert format_reward(PROMPTS, ["15", "-3", "1 2", ""]) == [1.0, 1.0, 0.0, 0.0]
    assert exact_answer_reward(PROMPTS[:1], ["16"], answer=["15"]) == [0.0]


def test_matrix_has_one_column_per_function_and_none_becomes_nan():
    def half(prompts, completions, **_):
        return [None if i % 2 else 0.5 for i in range(len(completions))]

    funcs = resolve_reward_funcs(["exact_answer", format_reward, half])
    r = score_completions(funcs, PROMPTS, COMPLETIONS, {"answer": ANSWERS})
    assert r.shape == (4, 3) and r.dtype == np.float64
    np.testing.assert_array_equal(r[:, 0], [1, 1, 1, 0])
    np.testing.assert_array_equal(r[:, 1], [1, 1, 1, 0])
    assert r[0, 2] == 0.5 and np.isnan(r[1, 2]) and np.isnan(r[3, 2])
    assert [reward_name(f) for f in funcs] == ["exact_answer", "format", "half"]


def test_weights_and_unscorable_rows_reach_the_advantages():
    def never(prompts, completions, **_):
        return [None] * len(completions)

    funcs = resolve_reward_funcs(["exact_answer", "format", never])
    r = score_completions(funcs, PROMPTS, COMPLETIONS, {"answer": ANSWERS})
    adv = compute_advantages(r, 2, weights=[2.0, 0.5, 1.0], scale_rewards="none")
    # group 1: both 2.5 → 0; group 2: 2.5 vs 0 → ±1.25
    np.testing.assert_allclose(adv, [0.0, 0.0, 1.25, -1.25])
    m = reward_metrics([r], 2, weights=[2.0, 0.5, 1.0], reward_names=["a", "f", "never"])
    assert m["reward"] == pytest.approx(7.5 / 4) and np.isnan(m["rewards/never/mean"])
    assert m["frac_reward_zero_std"] == 0.5


def test_columns_are_passed_by_keyword():
    seen = {}

    def spy(prompts, completions, *, answer, difficulty, **_):
        seen.update(answer=answer, difficulty=difficulty)
        return [0.0] * len(completions)

    score_completions([spy], PROMPTS, COMPLETIONS, {"answer": ANSWERS, "difficulty": [1, 2, 3, 4]})
    assert seen == {"answer": ANSWERS, "difficulty": [1, 2, 3, 4]}


@pytest.mark.parametrize(
    ("returned", "error", "match"),
    [
        ([1.0, 2.0], ValueError, r"'bad' returned 2 values for 4 completions"),
        ([1.0, "2", 0.0, 0.0], TypeError, r"'bad' returned '2' \(str\) for row 1"),
        ([1.0, True, 0.0, 0.0], TypeError, r"for row 1"),
        (1.0, TypeError, r"'bad' returned float"),
        ("1111", TypeError, r"'bad' returned str"),
    ],
)
def test_wrong_length_or_non_numbers_are_named(returned, error, match):
    def bad(prompts, completions, **_):
        return returned

    with pytest.raises(error, match=match):
        score_completions([bad], PROMPTS, COMPLETIONS)


def test_numpy_numbers_are_accepted():
    def np_values(prompts, completions, **_):
        return np.asarray([0.25, 1, 2, 3], np.float32)

    r = score_completions([np_values], PROMPTS, COMPLETIONS)
    np.testing.assert_array_equal(r[:, 0], [0.25, 1, 2, 3])


def test_resolution_errors():
    with pytest.raises(ConfigError, match="not a built-in reward .*did you mean 'exact_answer'"):
        resolve_reward_funcs(["exact"])
    with pytest.raises(ConfigError, match=r"reward_funcs\[0\]=3 is invalid: use a built-in name"):
        resolve_reward_funcs([3])
    with pytest.raises(ConfigError, match="at least one"):
        resolve_reward_funcs([])
    with pytest.raises(ValueError, match="column 'answer' has 1 values"):
        score_completions([format_reward], PROMPTS, COMPLETIONS, {"answer": ["1"]})
