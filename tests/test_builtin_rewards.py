"""Built-in rewards against hand-computed values: GSM8K / LaTeX answers with numeric
normalisation, the arithmetic task's scores unchanged, configurable format, DAPO length penalty."""

from __future__ import annotations

import random

import pytest

from jaxrl.config import ConfigError
from jaxrl.data.tasks import ArithmeticTask, Example
from jaxrl.rollout.rewards.answers import extract_answer, parse_number
from jaxrl.rollout.rewards.builtin import (
    ExactAnswer,
    FormatReward,
    LengthPenalty,
    exact_answer_reward,
    format_reward,
)

GSM8K_GOLD = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
)


@pytest.mark.parametrize(
    ("completion", "gold", "expected"),
    [
        ("The answer is \\boxed{1,234}.", "#### 1234", 1.0),
        ("The answer is \\boxed{1,234}.", "#### 1235", 0.0),
        ("so she sold 72 clips.\n#### 72", GSM8K_GOLD, 1.0),
        ("#### 72.0", GSM8K_GOLD, 1.0),
        ("#### $72", GSM8K_GOLD, 1.0),
        ("#### 72.", GSM8K_GOLD, 1.0),
        ("#### 71", GSM8K_GOLD, 0.0),
        ("72", GSM8K_GOLD, 1.0),
        ("\\boxed{\\frac{3}{4}}", "0.75", 1.0),
        ("\\boxed{\\dfrac{3}{4}}", "3/4", 1.0),
        ("3/4", "0.75", 1.0),
        ("6/8", "0.75", 1.0),
        ("2/3", "0.67", 0.0),
        ("\\boxed{75\\%}", "#### 75", 1.0),
        ("75%", "75", 1.0),
        ("\\boxed{\\$1{,}000.50}", "1000.5", 1.0),
        ("\\boxed{1\\,000}", "1000", 1.0),
        ("\\boxed{x^{2}+\\frac{1}{2}}", "x^{2}+1/2", 1.0),  # nested braces, compared as text
        ("first \\boxed{3} then \\boxed{4}", "4", 1.0),  # the last box counts
        ("<think>2+2</think><answer>4</answer>", "4", 1.0),
        ("<answer> \\boxed{-5} </answer>", "#### -5", 1.0),
        ("1,23", "123", 0.0),  # not a thousands grouping: text
        ("0.5", ".5", 0.0),  # ".5" is not canonical: text
        ("B", "B", 1.0),
        ("b", "B", 0.0),
        ("", "#### 0", 0.0),
    ],
)
def test_exact_answer_hand_computed(completion, gold, expected):
    assert exact_answer_reward(["q"], [completion], answer=[gold]) == [expected]


def test_extraction_and_numbers():
    assert extract_answer("a \\boxed{\\frac{1}{\\sqrt{2}}} b") == "\\frac{1}{\\sqrt{2}}"
    assert extract_answer("\\boxed{unclosed") == "\\boxed{unclosed"  # no complete box: text
    assert extract_answer(GSM8K_GOLD) == "72"
    assert extract_answer("####\n") == ""
    assert parse_number("1,234,567") == 1234567
    assert [parse_number(s) for s in ("02", "-0", "+5", "1,2345", "1.", "3/0")] == [None] * 6


@pytest.mark.slow
def test_exact_answer_keeps_the_arithmetic_task_scores():
    """Over the task alphabet the new comparison is the old one: stripped text equality."""
    task = ArithmeticTask(max_digits=2, ops="+-*", reverse_answer=True, pad_operands=True)
    golds = [e.answer for e in task.examples(300)] + ["0", "02", "-21", "10"]
    rng = random.Random(0)
    alphabet = task.alphabet
    completions = []
    for gold in golds:
        completions += [gold, f" {gold} ", gold[::-1], "0" + gold, "-" + gold, "+" + gold]
        completions += ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 4)))]
        completions += [gold.lstrip("0") or "0", "-0", gold + "0", gold + " =", "0" * len(gold)]
    for gold in golds:
        old = [ArithmeticTask.correctness_reward(Example("p", gold), c) for c in completions]
        new = exact_answer_reward(["p"] * len(completions), completions, answer=[gold] * len(old))
        assert new == old, gold
    fmt_old = [ArithmeticTask.format_reward(Example("p", ""), c) for c in completions]
    assert format_reward(["p"] * len(completions), completions) == fmt_old


def test_conversational_completions_and_missing_gold():
    conv = [
        [{"role": "assistant", "content": "so \\boxed{72}"}],
        [{"role": "assistant", "content": "7"}],
    ]
    assert exact_answer_reward(["q", "q"], conv, answer=["#### 72", None]) == [1.0, None]
    assert format_reward(["q"], [[{"role": "assistant", "content": " 12 "}]]) == [1.0]
    with pytest.raises(ValueError, match="needs the dataset's 'answer' column.*\\['solution'\\]"):
        ExactAnswer()(["q"], ["1"], solution=["1"], completion_ids=[[1]])


def test_format_pattern_is_configurable():
    think = FormatReward(pattern=r"<think>.*?</think>\s*<answer>.*?</answer>")
    completions = [
        "<think>a\nb</think>\n<answer>4</answer>",  # '.' matches newlines
        "  <think></think><answer>4</answer>\n",  # surrounding whitespace is stripped
        "<think>a</think><answer>4</answer> trailing",  # the whole completion must match
        "<answer>4</answer>",
    ]
    assert think(["q"] * 4, completions) == [1.0, 1.0, 0.0, 0.0]
    with pytest.raises(ConfigError, match=r"pattern='\(' is invalid: not a regular expression"):
        FormatReward(pattern="(")


def test_length_penalty_is_dapo_soft_overlong_punishment():
    # L_max = 10, L_cache = 4: 0 up to 6 tokens, then (6 - L) / 4, -1 from 10 on
    f = LengthPenalty(max_completion_len=10, soft_punish_cache=4)
    ids = [[0] * n for n in (0, 5, 6, 7, 8, 9, 10, 11, 30)]
    assert f([""] * 9, [""] * 9, completion_ids=ids) == [0, 0, 0, -0.25, -0.5, -0.75, -1, -1, -1]
    full = LengthPenalty(max_completion_len=4, soft_punish_cache=4)  # the ramp starts at 0
    assert full(["", ""], ["", ""], completion_ids=[[1], [1, 2, 3, 4]]) == [-0.25, -1.0]
    with pytest.raises(ConfigError, match="soft_punish_cache=11 is invalid"):
        LengthPenalty(max_completion_len=10, soft_punish_cache=11)
    with pytest.raises(ValueError, match="needs completion_ids"):
        f(["q"], ["a"])


@pytest.mark.parametrize(
    ("completion", "gold", "strict", "lenient"),
    [
        ("She sold 48 + 24 = 72 clips in total.", GSM8K_GOLD, 0.0, 1.0),
        ("So the answer is **72**", GSM8K_GOLD, 0.0, 1.0),
        ("72 clips, then 3 more days", GSM8K_GOLD, 0.0, 0.0),  # the last number counts
        ("It costs $1,234.50 in all.", "#### 1234.5", 0.0, 1.0),
        ("10 - 3 = 7", "7", 0.0, 1.0),
        ("the loss is -5", "-5", 0.0, 1.0),
        ("half: 3/4", "0.75", 0.0, 1.0),
        ("\\boxed{71} though 72 is close", GSM8K_GOLD, 0.0, 0.0),  # a box still wins
        ("#### 72\nfrom 48 and 24", GSM8K_GOLD, 1.0, 1.0),  # so does ####
        ("no number here", "#### 72", 0.0, 0.0),
        ("Paris", "Paris", 1.0, 1.0),  # no number: the whole text, as before
    ],
)
def test_exact_answer_last_number_fallback(completion, gold, strict, lenient):
    assert ExactAnswer()(["q"], [completion], answer=[gold]) == [strict]
    fallback = ExactAnswer(fallback="last_number")
    assert fallback(["q"], [completion], answer=[gold]) == [lenient]
    conv = [[{"role": "assistant", "content": completion}]]
    assert fallback(["q"], conv, answer=[gold]) == [lenient]


def test_exact_answer_fallback_is_checked():
    with pytest.raises(ConfigError, match="fallback='last' is invalid"):
        ExactAnswer(fallback="last")


def test_length_penalty_window_as_a_fraction_follows_the_length():
    quarter = LengthPenalty(max_completion_len=64, soft_punish_cache=0.25)
    assert quarter.cache_tokens == 16  # 0 up to 48 tokens, then (48 - L) / 16
    ids = [[0] * n for n in (48, 52, 56, 64, 70)]
    assert quarter([""] * 5, [""] * 5, completion_ids=ids) == [0, -0.25, -0.5, -1, -1]
    assert LengthPenalty(max_completion_len=512, soft_punish_cache=0.25).cache_tokens == 128
    assert LengthPenalty(max_completion_len=3, soft_punish_cache=0.1).cache_tokens == 1  # ≥ 1
    assert LengthPenalty(max_completion_len=10, soft_punish_cache=4).cache_tokens == 4
    for bad in (0, 0.0, 1.5, 11, True, "0.25"):
        with pytest.raises(ConfigError, match="soft_punish_cache=.* is invalid: .*a fraction"):
            LengthPenalty(max_completion_len=10, soft_punish_cache=bad)
