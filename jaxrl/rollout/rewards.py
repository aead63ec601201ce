"""Reward functions: plain Python callables scored on the host (TRL's signature).

A reward function has TRL's signature::

    reward(prompts: list[str], completions: list[str], **columns) -> list[float | None]

``columns`` are the dataset's other fields for the same rows (for the built-in task: ``answer``),
passed by keyword, so a function names the ones it needs and takes ``**kwargs`` for the rest.
It returns one value per completion; None means "cannot score this row" and becomes NaN (a row
every function leaves unscored gets advantage 0). Several functions are combined with
``GRPOConfig.reward_weights`` by ``jaxrl.losses.advantages``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jaxrl.data.tasks import ArithmeticTask, Example

RewardFunc = Callable[..., Sequence[float | None]]

__all__ = [
    "BUILTIN_REWARDS",
    "RewardFunc",
    "exact_answer_reward",
    "format_reward",
    "resolve_reward_funcs",
    "reward_name",
    "score_completions",
]


def exact_answer_reward(
    prompts: Sequence[str], completions: Sequence[str], *, answer: Sequence[str], **_: Any
) -> list[float]:
    """1.0 when the completion is exactly the expected answer (surrounding spaces ignored)."""
    return [
        ArithmeticTask.correctness_reward(Example(p, a), c)
        for p, c, a in zip(prompts, completions, answer, strict=True)
    ]


def format_reward(prompts: Sequence[str], completions: Sequence[str], **_: Any) -> list[float]:
    """1.0 when the completion is a bare integer (shape, not value)."""
    pairs = zip(prompts, completions, strict=True)
    return [ArithmeticTask.format_reward(Example(p, ""), c) for p, c in pairs]


BUILTIN_REWARDS: dict[str, RewardFunc] = {
    "exact_answer": exact_answer_reward,
    "format": format_reward,
}


def resolve_reward_funcs(funcs: Sequence[str | RewardFunc]) -> list[RewardFunc]:
    """Callables for a list of callables and/or built-in names (``BUILTIN_REWARDS``)."""
    out = []
    for f in funcs:
        if isinstance(f, str):
            if f not in BUILTIN_REWARDS:
                raise ValueError(
                    f"unknown reward function {f!r}: use one of {sorted(BUILTIN_REWARDS)} or pass "
                    "a callable (prompts, completions, **columns) -> list[float | None]"
                )
            out.append(BUILTIN_REWARDS[f])
        elif callable(f):
            out.append(f)
        else:
            raise TypeError(f"reward function {f!r} is neither a callable nor a built-in name")
    if not out:
        raise ValueError("GRPO needs at least one reward function")
    return out


def reward_name(func: RewardFunc) -> str:
    """The name a function's metrics are logged under (``rewards/<name>/mean``)."""
    name = getattr(func, "__name__", type(func).__name__)
    return name.removesuffix("_reward") if name.endswith("_reward") else name


def _as_float(value: Any, name: str, row: int) -> float:
    if value is None:
        return math.nan
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"reward function {name!r} returned {value!r} ({type(value).__name__}) for row "
            f"{row}: return a float (or None for a row it cannot score)"
        )
    value = float(value)
    if math.isinf(value):
        raise ValueError(
            f"reward function {name!r} returned {value} for row {row}: rewards must be finite "
            "(return None or NaN for a row it cannot score)"
        )
    return value


def score_completions(
    funcs: Sequence[RewardFunc],
    prompts: Sequence[str],
    completions: Sequence[str],
    columns: Mapping[str, Sequence[Any]] | None = None,
) -> np.ndarray:
    """float64 ``[B, F]``: function k's reward of row i at ``[i, k]``; None → NaN.

    Raises ``ValueError`` when a function returns the wrong number of values or ±inf, and
    ``TypeError`` when a value is not a number (bools included), naming the function and the
    row.
    """
    n = len(completions)
    if len(prompts) != n:
        raise ValueError(f"{len(prompts)} prompts for {n} completions")
    columns = dict(columns or {})
    for key, values in columns.items():
        if len(values) != n:
            raise ValueError(f"column {key!r} has {len(values)} values for {n} completions")
    out = np.empty((n, len(funcs)), np.float64)
    for k, func in enumerate(funcs):
        name = reward_name(func)
        values = func(list(prompts), list(completions), **columns)
        if isinstance(values, str | bytes) or not isinstance(values, Sequence | np.ndarray):
            raise TypeError(
                f"reward function {name!r} returned {type(values).__name__}: return a list with "
                f"one float (or None) per completion"
            )
        if len(values) != n:
            raise ValueError(
                f"reward function {name!r} returned {len(values)} values for {n} completions: "
                "return one float (or None) per completion"
            )
        out[:, k] = [_as_float(v, name, i) for i, v in enumerate(values)]
    return out
