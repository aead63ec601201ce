"""Built-in task: the noisy SFT set (``corrupt_answers``)."""

from __future__ import annotations

import pytest

from jaxrl.data.tasks import ArithmeticTask, corrupt_answers

TASK = ArithmeticTask(max_digits=2, reverse_answer=True, pad_operands=True)


@pytest.mark.parametrize("fraction", [0.0, 0.25, 1.0])
def test_exactly_the_fraction_changes_by_one_digit(fraction):
    clean = TASK.examples(400)
    noisy = corrupt_answers(clean, fraction, seed=3)
    changed = [(a, b) for a, b in zip(clean, noisy, strict=True) if a != b]
    assert len(changed) == round(fraction * len(clean))
    for a, b in changed:
        assert a.prompt == b.prompt and len(a.answer) == len(b.answer)
        diffs = [i for i, (x, y) in enumerate(zip(a.answer, b.answer, strict=True)) if x != y]
        assert len(diffs) == 1 and b.answer[diffs[0]].isdigit()


def test_noise_is_seeded_and_spread_over_digits():
    clean = TASK.examples(2000)
    a = corrupt_answers(clean, 0.3, seed=0)
    assert a == corrupt_answers(clean, 0.3, seed=0)
    assert a != corrupt_answers(clean, 0.3, seed=1)
    new_digits = {
        y
        for c, n in zip(clean, a, strict=True)
        for x, y in zip(c.answer, n.answer, strict=True)
        if x != y
    }
    assert new_digits == set("0123456789")


def test_noise_fraction_is_validated():
    with pytest.raises(ValueError, match="fraction"):
        corrupt_answers(TASK.examples(4), 1.5, seed=0)
