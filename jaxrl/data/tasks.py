"""Built-in verifiable tasks: synthetic arithmetic with exact-answer and format rewards.

A task yields ``Example(prompt, answer)`` pairs deterministically from a seed. Train and
held-out splits never share a problem. Everything is character level, so the tasks run with
``char_tokenizer(task.alphabet)`` and need no download.

The trainers read a task as data in TRL's formats (:meth:`ArithmeticTask.dataset`): the rows go
through the reader's validation and ``jaxrl.data.documents`` like a user's file, with the same
length limits, so a built-in run and a run on the same rows written to JSONL see the same tokens.
"""

from __future__ import annotations

import dataclasses
import re
import zlib

import numpy as np

from jaxrl.data.datasets import Dataset, Kind, rows_dataset
from jaxrl.data.tokenizer import TextTokenizer, char_tokenizer

TASK_SOURCE = "arithmetic"  # the built-in task's name in row locations and cache identities


@dataclasses.dataclass(frozen=True)
class Example:
    """One problem: the prompt shown to the model and the exact expected answer."""

    prompt: str
    answer: str


_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
_ANSWER_RE = re.compile(r"^-?\d+$")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ArithmeticTask:
    """``a<op>b=`` → ``str(a op b)`` with operands of ``min_digits..max_digits`` digits.

    ``reverse_answer`` writes the result least-significant digit first (``12+39=`` → ``15``),
    which small models learn far faster because each digit then depends only on digits
    already seen (the carry flows left to right).
    """

    min_digits: int = 1
    max_digits: int = 3
    ops: str = "+"
    seed: int = 0
    reverse_answer: bool = False  # write the answer least-significant digit first
    pad_operands: bool = False  # zero-pad operands to max_digits (fixed positions)
    alphabet: str = "0123456789+-*= "

    def __post_init__(self):
        if not 1 <= self.min_digits <= self.max_digits:
            raise ValueError(
                f"need 1 <= min_digits ({self.min_digits}) <= max_digits ({self.max_digits})"
            )
        if not self.ops or any(o not in _OPS for o in self.ops):
            raise ValueError(f"ops={self.ops!r}: use characters from {''.join(_OPS)}")

    def _draw(self, rng: np.random.Generator) -> tuple[int, str, int]:
        def operand() -> int:
            digits = int(rng.integers(self.min_digits, self.max_digits + 1))
            lo = 0 if digits == 1 else 10 ** (digits - 1)
            return int(rng.integers(lo, 10**digits))

        return operand(), self.ops[int(rng.integers(len(self.ops)))], operand()

    def examples(self, n: int, *, split: str = "train") -> list[Example]:
        """``n`` distinct problems of a split; ``eval`` problems never occur in ``train``.

        Splits are decided by a CRC of the problem text (10% eval): disjoint for any sizes.
        """
        if split not in ("train", "eval"):
            raise ValueError(f"split={split!r}: use 'train' or 'eval'")
        rng = np.random.default_rng([self.seed, 0 if split == "train" else 1])
        want_eval = split == "eval"
        seen: set[tuple[int, str, int]] = set()
        out: list[Example] = []
        space = len(self.ops) * (10**self.max_digits) ** 2
        for _ in range(50 * n + 1000):
            if len(out) == n:
                break
            a, op, b = self._draw(rng)
            if (a, op, b) in seen or (zlib.crc32(f"{a}{op}{b}".encode()) % 10 == 0) != want_eval:
                continue
            seen.add((a, op, b))
            answer = str(_OPS[op](a, b))
            if self.reverse_answer:  # "-12" -> "-21": the sign stays in front
                sign, digits = ("-", answer[1:]) if answer.startswith("-") else ("", answer)
                answer = sign + digits[::-1]
            w = self.max_digits if self.pad_operands else 0
            out.append(
                Example(prompt=f"{a:0{w}d}{op}{b:0{w}d}=" if w else f"{a}{op}{b}=", answer=answer)
            )
        if len(out) < n:
            raise ValueError(
                f"cannot draw {n} distinct {split} problems from about {space}; "
                "raise max_digits or lower the split size"
            )
        return out

    def rows(self, kind: Kind, n: int, *, split: str = "train") -> list[dict[str, str]]:
        """``n`` problems of a split as rows in TRL's format for a trainer: ``sft`` →
        ``prompt``/``completion``; ``dpo`` → ``prompt``/``chosen``/``rejected`` (rejected: the
        answer with one digit changed, a deterministic function of the seed and the prompt);
        ``grpo`` → ``prompt`` and the ``answer`` column the reward functions read."""
        examples = self.examples(n, split=split)
        if kind == "sft":
            return [{"prompt": e.prompt, "completion": e.answer} for e in examples]
        if kind == "dpo":
            return [
                {
                    "prompt": e.prompt,
                    "chosen": e.answer,
                    "rejected": _corrupt_one_digit(
                        e.answer, e.prompt, self.seed, self.reverse_answer
                    ),
                }
                for e in examples
            ]
        if kind == "grpo":
            return [{"prompt": e.prompt, "answer": e.answer} for e in examples]
        raise ValueError(f"kind={kind!r}: use 'sft', 'dpo' or 'grpo'")

    def dataset(self, kind: Kind, n: int, *, split: str = "train") -> Dataset:
        """:meth:`rows` validated as the reader validates a file (rows named
        ``arithmetic[split] row i``)."""
        return rows_dataset(self.rows(kind, n, split=split), kind, source=TASK_SOURCE, split=split)

    def tokenizer(self) -> TextTokenizer:
        """The task's character tokenizer."""
        return char_tokenizer(self.alphabet)

    @staticmethod
    def correctness_reward(example: Example, completion: str) -> float:
        """1.0 when the completion is exactly the answer (surrounding spaces ignored), else 0."""
        return float(completion.strip() == example.answer)

    @staticmethod
    def format_reward(example: Example, completion: str) -> float:
        """1.0 when the completion is a bare integer, else 0 (shape, not value)."""
        return float(bool(_ANSWER_RE.match(completion.strip())))


def _corrupt_one_digit(answer: str, key: str, seed: int, msd_last: bool) -> str:
    """``answer`` with one digit replaced by a different digit, chosen from a hash of ``key``.

    The most significant digit of a multi-digit answer never becomes 0 (the wrong answer keeps
    the shape of a number); ``msd_last`` says it is the last character (reversed answers).
    """
    rng = np.random.default_rng([seed, zlib.crc32(key.encode())])
    digits = [i for i, ch in enumerate(answer) if ch.isdigit()]
    pos = digits[int(rng.integers(len(digits)))]
    msd = digits[-1] if msd_last else digits[0]
    lowest = 1 if (pos == msd and len(digits) > 1) else 0
    choices = [d for d in range(lowest, 10) if str(d) != answer[pos]]
    new = str(choices[int(rng.integers(len(choices)))])
    return answer[:pos] + new + answer[pos + 1 :]
