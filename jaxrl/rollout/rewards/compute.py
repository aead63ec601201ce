"""Calling reward functions exactly as TRL's GRPOTrainer does, and checking what they return
(docs/rewards.md).

A reward function is a plain Python callable scored on the host. It is called by keyword, as
TRL (``GRPOTrainer._calculate_rewards``, v0.20 and later, including 1.x) calls it::

    reward(prompts=..., completions=..., completion_ids=..., trainer_state=..., **columns)

- ``prompts``: the dataset's prompts, text or (conversational data) lists of messages;
- ``completions``: the decoded completions; for conversational prompts each is
  ``[{"role": "assistant", "content": text}]`` and, as in TRL, a prompt ending in an assistant
  message has that message removed from ``prompts`` and its content put before the text;
- ``completion_ids``: each completion's token ids (a list of ints, EOS included);
- ``trainer_state``: ``TrainingProgress`` (``global_step``, ``max_steps``; TRL passes
  transformers' ``TrainerState``, whose fields of those names mean the same; TRL added it in
  v0.20);
- every other dataset column (``answer``, ...) as a list in row order.

So a TRL reward function runs unchanged: it names what it needs and takes ``**kwargs`` for the
rest. It returns one value per completion; None means "cannot score this row" and becomes NaN
(a row every function leaves unscored gets advantage 0). Several functions are combined with
``GRPOConfig.reward_weights`` by ``jaxrl.losses.advantages``.

What is an error, naming the function and the rows: an exception inside the function
(``RewardFunctionError``, the original chained), a call that takes longer than
``grpo.reward_timeout`` (``RewardTimeoutError``; the run stops, as a hung thread cannot be
stopped), the wrong number of values, a non-number, ±inf, and a magnitude above
``MAX_ABS_REWARD`` (1e30): such a value is finite but its square overflows float64, so the
group std behind the advantages would be inf and every advantage 0 or NaN; rescale the reward
instead.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jaxrl.runtime.mesh import from_primary
from jaxrl.runtime.timeout import CallTimeoutError, call_with_deadline

RewardFunc = Callable[..., Sequence[float | None]]
MAX_ABS_REWARD = 1e30  # larger finite rewards overflow the float64 group variance
CALL_KEYWORDS = ("prompts", "completions", "completion_ids", "trainer_state")

__all__ = [
    "MAX_ABS_REWARD",
    "RewardFunc",
    "check_reward",
    "RewardFunctionError",
    "RewardTimeoutError",
    "TrainingProgress",
    "reward_inputs",
    "reward_name",
    "reward_names",
    "score_completions",
    "score_once",
]


class RewardFunctionError(RuntimeError):
    """A reward function raised; the message names it and the rows it was scoring."""


class RewardTimeoutError(RewardFunctionError):
    """A reward function did not return within ``grpo.reward_timeout``; it names the rows."""


@dataclasses.dataclass(frozen=True)
class TrainingProgress:
    """What TRL's ``trainer_state`` argument (transformers' ``TrainerState``) offers reward
    functions, under transformers' field names."""

    global_step: int = 0  # optimizer steps done before this generation
    max_steps: int = 0  # optimizer steps the run trains for


def reward_name(func: RewardFunc) -> str:
    """The name a function's metrics are logged under (``rewards/<name>/mean``): its
    ``__name__`` without a ``_reward`` suffix."""
    name = getattr(func, "__name__", type(func).__name__)
    return name.removesuffix("_reward") if name.endswith("_reward") else name


def reward_names(funcs: Sequence[RewardFunc]) -> list[str]:
    """``reward_name`` of each function, made unique by a ``_2``, ``_3``, ... suffix (two
    ``format`` entries with different patterns log ``format`` and ``format_2``)."""
    out: list[str] = []
    for func in funcs:
        base, k = reward_name(func), 1
        name = base
        while name in out:
            k += 1
            name = f"{base}_{k}"
        out.append(name)
    return out


def reward_inputs(prompts: Sequence[Any], texts: Sequence[str]) -> tuple[list[Any], list[Any]]:
    """``(prompts, completions)`` as TRL hands them to reward functions: text stays text; a
    conversational prompt (a list of messages) gives ``[{"role": "assistant", "content": ...}]``,
    with a trailing assistant message moved from the prompt to the completion's start."""
    out_prompts, out_completions = [], []
    for prompt, text in zip(prompts, texts, strict=True):
        if isinstance(prompt, str):
            out_prompts.append(prompt)
            out_completions.append(text)
            continue
        messages = list(prompt)
        bootstrap = ""
        if messages and messages[-1].get("role") == "assistant":
            bootstrap = messages.pop()["content"]
        out_prompts.append(messages)
        out_completions.append([{"role": "assistant", "content": bootstrap + text}])
    return out_prompts, out_completions


def check_reward(value: float, where: str) -> None:
    """Raise ``ValueError`` (``where`` names the value) unless ``value`` is a usable reward:
    NaN (unscored) or finite with ``|value| <= MAX_ABS_REWARD``."""
    if math.isinf(value):
        raise ValueError(
            f"{where}: rewards must be finite (return None or NaN for a row that cannot be scored)"
        )
    if abs(value) > MAX_ABS_REWARD:
        raise ValueError(
            f"{where}: |reward| must be at most {MAX_ABS_REWARD:g} (the group std of larger "
            "values overflows float64); rescale the reward"
        )


def _as_float(value: Any, name: str, row: int) -> float:
    if value is None:
        return math.nan
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"reward function {name!r} returned {value!r} ({type(value).__name__}) for row "
            f"{row}: return a float (or None for a row it cannot score)"
        )
    value = float(value)
    check_reward(value, f"reward function {name!r} returned {value:g} for row {row}")
    return value


def score_once(
    funcs: Sequence[RewardFunc],
    prompts: Sequence[Any],
    completions: Sequence[Any],
    columns: Mapping[str, Sequence[Any]] | None = None,
    **kwargs: Any,
) -> np.ndarray:
    """:func:`score_completions` computed once per completion whatever the process count:
    process 0 calls the reward functions on the whole generation batch, as a one-process run
    does, and broadcasts the rewards (``jaxrl.runtime.mesh.from_primary``). Every process trains
    on the same rewards, so on the same advantages, even when a function is non-deterministic
    or reads its host (docs/rewards.md, "Several processes"); an LLM judge or a sandbox runs
    once, not once per host."""
    return from_primary(
        lambda: score_completions(funcs, prompts, completions, columns, **kwargs),
        (len(completions), len(funcs)),
    )


def score_completions(
    funcs: Sequence[RewardFunc],
    prompts: Sequence[Any],
    completions: Sequence[Any],
    columns: Mapping[str, Sequence[Any]] | None = None,
    *,
    completion_ids: Sequence[Sequence[int]] | None = None,
    trainer_state: TrainingProgress | None = None,
    timeout: float | None = None,
) -> np.ndarray:
    """float64 ``[B, F]``: function k's reward of row i at ``[i, k]``; None → NaN.

    ``prompts`` and ``completions`` as the functions receive them (``reward_inputs``); every
    function is called with the keywords of the module docstring, within ``timeout`` seconds
    per call when given (``jaxrl.runtime.timeout``). Raises ``RewardTimeoutError`` when a
    call takes longer, ``RewardFunctionError`` when a function raises, ``ValueError`` when it
    returns the wrong number of values, ±inf or a magnitude above ``MAX_ABS_REWARD``, and
    ``TypeError`` when a value is not a number (bools included), naming the function and the
    row.
    """
    n = len(completions)
    if len(prompts) != n:
        raise ValueError(f"{len(prompts)} prompts for {n} completions")
    columns = dict(columns or {})
    for key, values in columns.items():
        if key in CALL_KEYWORDS:
            raise ValueError(
                f"dataset column {key!r} clashes with the reward functions' argument of that "
                "name: rename the column"
            )
        if len(values) != n:
            raise ValueError(f"column {key!r} has {len(values)} values for {n} completions")
    if completion_ids is not None and len(completion_ids) != n:
        raise ValueError(f"{len(completion_ids)} completion_ids for {n} completions")
    ids = None if completion_ids is None else [[int(t) for t in x] for x in completion_ids]
    out = np.empty((n, len(funcs)), np.float64)
    for k, (func, name) in enumerate(zip(funcs, reward_names(funcs), strict=True)):
        call = functools.partial(
            func,
            prompts=list(prompts),
            completions=list(completions),
            completion_ids=ids,
            trainer_state=trainer_state,
            **columns,
        )
        first = str(prompts[0])[:60] if n else ""
        try:
            values = call_with_deadline(call, timeout, name=f"reward function {name!r}")
        except CallTimeoutError:
            raise RewardTimeoutError(
                f"reward function {name!r} did not return within grpo.reward_timeout={timeout:g} "
                f"s (scoring rows 0-{n - 1} of the generation batch; the first prompt is "
                f"{first!r}); it keeps running in a background thread, which cannot be stopped, "
                "so the run stops: fix the function, or raise grpo.reward_timeout"
            ) from None
        except Exception as e:
            detail = (str(e).strip().splitlines() or [""])[0]
            raise RewardFunctionError(
                f"reward function {name!r} raised {type(e).__name__}: {detail} (scoring rows "
                f"0-{n - 1} "
                f"of the generation batch; the first prompt is {first!r}); fix the function, or "
                "return None for rows it cannot score"
            ) from e
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
