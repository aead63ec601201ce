"""KTO's unpaired examples: ``{prompt, completion, label}`` rows (TRL's unpaired preference
format) → tokenised prompt and completion per example, and the documents a step trains on.

Rows are read like SFT's prompt/completion rows (strings or conversations, the tokenizer and
chat template of ``model.path``) plus a boolean ``label`` (True = desirable). The built-in
task's rows come from its preference pairs: pair i gives one example, the correct answer
(desirable) for even i and the wrong one (undesirable) for odd i, so no prompt appears twice.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxrl.data.datasets import DataError, Dataset
from jaxrl.data.documents import (
    LengthReport,
    _completion_ids,
    _in_row,
    prompt_completion_document,
    prompt_ids,
)


@dataclasses.dataclass
class Examples:
    """Tokenised unpaired examples; example i is document i of a step."""

    prompts: list[np.ndarray]  # int32
    completions: list[np.ndarray]  # int32
    labels: np.ndarray  # bool [N]: desirable

    def __len__(self) -> int:
        return len(self.labels)

    def document(
        self, prompt: int, completion: int, max_length: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, mask)`` of prompt ``prompt`` + completion ``completion`` (the KL pairs mix
        them; ``document(i, i)`` is example i), the completion cut to fit ``max_length``."""
        p, c = self.prompts[prompt], self.completions[completion]
        if max_length is not None:
            c = c[: max(max_length - len(p), 1)]
        return prompt_completion_document(p, c)

    def documents(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        pairs = [self.document(i, i) for i in range(len(self))]
        return [p[0] for p in pairs], [p[1] for p in pairs]


def task_rows(pair_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Unpaired rows from preference pairs: pair i → its chosen (desirable) for even i, its
    rejected (undesirable) for odd i."""
    return [
        {
            "prompt": r["prompt"],
            "completion": r["chosen"] if i % 2 == 0 else r["rejected"],
            "label": i % 2 == 0,
        }
        for i, r in enumerate(pair_rows)
    ]


def _label(value: Any, at: str) -> bool:
    if isinstance(value, bool | np.bool_) or value in (0, 1):
        return bool(value)
    raise DataError(f"{at}: 'label' must be true (desirable) or false (undesirable), got {value!r}")


def kto_examples(
    data: Dataset, tok: Any, *, max_length: int, max_prompt_length: int | None
) -> tuple[Examples, LengthReport]:
    """Tokenise ``{prompt, completion, label}`` rows; prompts over ``max_prompt_length`` keep
    their last tokens, completions are cut to fit ``max_length``; rows with no room dropped."""
    prompts, completions, labels = [], [], []
    over = dropped = 0
    for row, at in zip(data.rows, data.where, strict=True):
        if "label" not in row or "completion" not in row or "prompt" not in row:
            raise DataError(f"{at}: a KTO row needs prompt, completion and label; it has "
                            f"{sorted(row)}")  # fmt: skip
        label = _label(row["label"], at)
        prompt = _in_row(at, prompt_ids, tok, row["prompt"])
        completion = _in_row(
            at, _completion_ids, tok, row["prompt"], prompt, row["completion"], "completion"
        )
        touched = False
        if max_prompt_length is not None and len(prompt) > max_prompt_length:
            prompt, touched = prompt[-max_prompt_length:], True
        room = max_length - len(prompt)
        if len(completion) > room:
            completion, touched = completion[: max(room, 0)], True
        over += touched
        if room < 1 or not completion:
            dropped += 1
            continue
        prompts.append(np.asarray(prompt, np.int32))
        completions.append(np.asarray(completion, np.int32))
        labels.append(label)
    if not labels:
        raise DataError(f"{data.source}: every row was dropped (no room for a completion)")
    report = LengthReport(rows=len(data), over_length=over, dropped=dropped)
    return Examples(prompts, completions, np.asarray(labels, bool)), report
