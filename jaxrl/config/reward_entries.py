"""The shape of ``grpo.reward_funcs`` entries, checked without importing anything.

An entry is a built-in name, a mapping ``{name: <built-in>, <parameter>: ...}``,
``"package.module:function"`` (or TRL's ``"package.module.function"``),
``"path/to/file.py:function"``, or (from Python) a callable (docs/rewards.md). The config checks
this much when it is built; the trainer loads the functions (``jaxrl.rollout.rewards.specs``),
with the same errors for what it finds wrong.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from typing import Any

from jaxrl.config.base import config_error

__all__ = [
    "BUILTIN_REWARD_NAMES",
    "check_reward_spec",
    "check_reward_specs",
    "did_you_mean",
    "reward_file_spec",
]

# Names of the built-in reward functions (``jaxrl.rollout.rewards.builtin`` maps each to its class)
BUILTIN_REWARD_NAMES = ("exact_answer", "format", "length_penalty")


def reward_file_spec(spec: str) -> tuple[str, str] | None:
    """``(path, function)`` of a ``"path/to/file.py:function"`` reward entry, else None."""
    path, sep, func = spec.rpartition(":")
    return (path, func) if sep and path.endswith(".py") else None


def check_reward_spec(where: str, spec: Any) -> None:
    """Check the shape of one ``reward_funcs`` entry, without importing anything: a built-in
    name, a mapping ``{name: <built-in>, ...}``, ``"pkg.module:function"`` (or
    ``"pkg.module.function"``), ``"file.py:function"``, or a callable. ``where`` names the entry
    in the ``ConfigError``."""
    known = ", ".join(BUILTIN_REWARD_NAMES)
    if isinstance(spec, Mapping):
        name = spec.get("name")
        if not isinstance(name, str) or name not in BUILTIN_REWARD_NAMES:
            raise config_error(
                where,
                dict(spec),
                "a mapping sets the parameters of a built-in reward: give 'name' as one of "
                f"{known}" + did_you_mean(str(name), BUILTIN_REWARD_NAMES),
            )
    elif isinstance(spec, str):
        if spec in BUILTIN_REWARD_NAMES or reward_file_spec(spec) is not None:
            return
        if ":" not in spec and "." not in spec:
            raise config_error(
                where,
                spec,
                f"not a built-in reward ({known})"
                + did_you_mean(spec, BUILTIN_REWARD_NAMES)
                + "; for your own function write 'package.module:function' or "
                "'path/to/file.py:function'",
            )
    elif not callable(spec):
        raise config_error(
            where,
            spec,
            "use a built-in name, 'package.module:function', 'path/to/file.py:function', a "
            "mapping {name: <built-in>, ...}, or (from Python) a callable",
        )


def check_reward_specs(specs: Any, field: str = "reward_funcs") -> None:
    """``check_reward_spec`` of every entry of a list (``field[i]`` in errors); at least one."""
    if isinstance(specs, str | Mapping) or not isinstance(specs, list | tuple):
        raise config_error(field, specs, "give a list of reward functions")
    if not specs:
        raise config_error(field, list(specs), "GRPO needs at least one reward function")
    for i, spec in enumerate(specs):
        check_reward_spec(f"{field}[{i}]", spec)


def did_you_mean(name: str, known: Sequence[str]) -> str:
    """``"; did you mean 'x'?"`` for the closest of ``known``, else empty."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.5)
    return f"; did you mean {close[0]!r}?" if close else ""
