"""Built-in reward functions, usable by name in ``grpo.reward_funcs`` (docs/rewards.md).

Each is a frozen dataclass whose fields are its parameters and whose ``__call__`` has TRL's
reward signature ``(prompts, completions, **kwargs) -> list[float | None]`` (completions are text,
or ``[{"role": "assistant", "content": text}]`` for conversational data). In YAML a bare name
takes the defaults; a mapping ``{name: format, pattern: "..."}`` sets parameters.

- ``exact_answer``: 1.0 when the completion's final answer equals the ``answer`` column's
  (``jaxrl.rollout.rewards.answers``: ``\\boxed{}``, ``<answer>``, GSM8K ``####``, numeric
  normalisation); None (unscored) where the gold is None. ``fallback: last_number`` scores the
  completion's last number when it has no ``\\boxed{}`` / ``<answer>`` / ``####``.
- ``format``: 1.0 when the whole completion (surrounding whitespace stripped) matches
  ``pattern`` (``re.fullmatch``, ``.`` matching newlines); default: a bare integer.
- ``length_penalty``: DAPO's soft overlong punishment (arXiv:2503.14476, eq. 13; TRL's
  ``get_soft_overlong_punishment``) on the completion's token count ``L`` (EOS included):
  0 for ``L ≤ max_completion_len − soft_punish_cache``, then ``(max − cache − L) / cache`` down
  to −1 at ``L = max_completion_len``, −1 beyond. A ``soft_punish_cache`` in (0, 1) is a fraction
  of ``max_completion_len`` (``0.25``: a quarter), so the window follows that length.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any, ClassVar

from jaxrl.config.base import config_error, require, require_choice
from jaxrl.rollout.rewards.answers import ANSWER_FALLBACKS, answers_match

__all__ = [
    "BUILTIN_REWARDS",
    "ExactAnswer",
    "FormatReward",
    "LengthPenalty",
    "completion_text",
    "exact_answer_reward",
    "format_reward",
]


def completion_text(completion: Any) -> str:
    """The text of a completion: itself, or the last message's content of a conversational
    completion (a list of ``{"role", "content"}`` messages)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Sequence) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    raise TypeError(
        f"completion {completion!r} is neither text nor a list of messages "
        '[{"role": "assistant", "content": ...}]'
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExactAnswer:
    """1.0 when the final answer equals the ``answer`` column's, else 0.0 (None: no gold)."""

    __name__: ClassVar[str] = "exact_answer_reward"
    fallback: str = "text"  # no \boxed{}/<answer>/####: "text" (whole text) or "last_number"

    def __post_init__(self) -> None:
        require_choice("fallback", self.fallback, ANSWER_FALLBACKS)

    def __call__(
        self,
        prompts: Sequence[Any],
        completions: Sequence[Any],
        *,
        answer: Sequence[Any] | None = None,
        **columns: Any,
    ) -> list[float | None]:
        if answer is None:
            raise ValueError(
                "exact_answer needs the dataset's 'answer' column; the batch has columns "
                f"{sorted(k for k in columns if k not in ('completion_ids', 'trainer_state'))}"
            )
        return [
            None
            if gold is None
            else float(answers_match(completion_text(c), str(gold), fallback=self.fallback))
            for c, gold in zip(completions, answer, strict=True)
        ]


@dataclasses.dataclass(frozen=True, kw_only=True)
class FormatReward:
    """1.0 when the stripped completion matches ``pattern`` in full, else 0.0."""

    __name__: ClassVar[str] = "format_reward"
    pattern: str = r"-?\d+"  # regex the whole stripped completion must match (DOTALL)

    def __post_init__(self) -> None:
        try:
            compiled = re.compile(self.pattern, re.DOTALL)
        except (re.error, TypeError) as e:
            example = r"'<think>.*?</think>\s*<answer>.*?</answer>'"
            fix = f"not a regular expression ({e}); e.g. {example}"
            raise config_error("pattern", self.pattern, fix) from None
        object.__setattr__(self, "_compiled", compiled)

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **_: Any) -> list[float]:
        match = self._compiled.fullmatch  # type: ignore[attr-defined]
        return [float(match(completion_text(c).strip()) is not None) for c in completions]


@dataclasses.dataclass(frozen=True, kw_only=True)
class LengthPenalty:
    """DAPO's soft overlong punishment of the completion's token count (0 down to −1)."""

    __name__: ClassVar[str] = "length_penalty_reward"
    max_completion_len: int  # L_max: −1 from here on; YAML default grpo.max_completion_length
    soft_punish_cache: int | float  # L_cache, the ramp's width: tokens, or a fraction in (0, 1)

    def __post_init__(self) -> None:
        n, cache = self.max_completion_len, self.soft_punish_cache
        require(n >= 1, "max_completion_len", n, "use a positive token count")
        fix = (
            f"use a token count 1 ≤ soft_punish_cache ≤ max_completion_len ({n}), or a fraction "
            "of it in (0, 1) that follows max_completion_length (0.25: a quarter)"
        )
        ok = isinstance(cache, int | float) and not isinstance(cache, bool)
        if ok and 0 < cache < 1:
            tokens = max(1, round(cache * n))
        else:
            ok = ok and float(cache).is_integer() and 1 <= cache <= n
            tokens = int(cache) if ok else 0
        require(ok, "soft_punish_cache", cache, fix)
        object.__setattr__(self, "_cache", tokens)

    @property
    def cache_tokens(self) -> int:
        """The ramp's width in tokens (a fractional ``soft_punish_cache`` resolved)."""
        return self._cache  # type: ignore[attr-defined]

    def __call__(
        self,
        prompts: Sequence[Any],
        completions: Sequence[Any],
        *,
        completion_ids: Sequence[Sequence[int]] | None = None,
        **_: Any,
    ) -> list[float]:
        if completion_ids is None:
            raise ValueError("length_penalty needs completion_ids (the completions' token ids)")
        cache = self.cache_tokens
        start = self.max_completion_len - cache
        out = []
        for ids in completion_ids:
            n = len(ids)
            out.append(0.0 if n <= start else max(-1.0, (start - n) / cache))
        return out


BUILTIN_REWARDS: dict[str, type] = {
    "exact_answer": ExactAnswer,
    "format": FormatReward,
    "length_penalty": LengthPenalty,
}

exact_answer_reward = ExactAnswer()
format_reward = FormatReward()
