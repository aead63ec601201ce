"""Reward functions named in a config (``grpo.reward_funcs``) → callables, checked up front.

An entry is one of (docs/rewards.md):

- a built-in name: ``exact_answer``, ``format``, ``length_penalty``
  (``jaxrl.rollout.rewards.builtin``), with its default parameters;
- a mapping ``{name: <built-in>, <parameter>: <value>, ...}``, e.g.
  ``{name: format, pattern: "<think>.*?</think>\\s*<answer>.*?</answer>"}``;
  ``length_penalty``'s ``max_completion_len`` defaults to ``grpo.max_completion_length``;
- ``"package.module:function"`` (or TRL's ``"package.module.function"``), imported;
- ``"path/to/file.py:function"``, loaded from that file. In a YAML file a relative path is
  relative to the directory of that YAML file (``anchor_reward_paths``); given any other way
  (``--set``, Python) it is relative to the current directory;
- from Python, any callable.

The config checks each entry's shape when it is built (``jaxrl.config.reward_entries``);
the trainer loads them here, once, when a run starts, before the SFT warm start and before any
compile. Every failure is a ``ConfigError`` naming the entry, its value and what is wrong
("module 'x' has no function 'y'", "file '...' does not exist", ...).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import sys
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from jaxrl.config.base import ConfigError, config_error, from_dict
from jaxrl.config.reward_entries import (
    check_reward_spec,
    check_reward_specs,
    did_you_mean,
    reward_file_spec,
)
from jaxrl.rollout.rewards.builtin import BUILTIN_REWARDS
from jaxrl.rollout.rewards.compute import RewardFunc

__all__ = ["load_named", "load_reward_func", "resolve_reward_funcs"]

_FILE_MODULES = "_jaxrl_reward_files"  # sys.modules prefix of functions loaded from files


def _load_file(where: str, spec: str, path: str) -> ModuleType:
    file = Path(path).resolve()
    if not file.is_file():
        raise config_error(
            where,
            spec,
            f"file '{file}' does not exist (a relative path in a YAML file is relative to that "
            "file's directory, anywhere else to the current directory)",
        )
    name = f"{_FILE_MODULES}.{file.stem}_{zlib.crc32(str(file).encode()):08x}"
    if name in sys.modules:  # loaded once per process: the same function objects every time
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, file)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise config_error(
            where, spec, f"executing file '{file}' raised {type(e).__name__}: {e}"
        ) from e
    return module


def _import(where: str, spec: str, module_name: str) -> ModuleType:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise config_error(
            where,
            spec,
            f"cannot import module {module_name!r} ({e}); install it, put it on PYTHONPATH, or "
            "name a file: 'path/to/file.py:function'",
        ) from e
    except Exception as e:
        raise config_error(
            where, spec, f"importing module {module_name!r} raised {type(e).__name__}: {e}"
        ) from e


def _attribute(where: str, spec: str, module: ModuleType, label: str, attr: str) -> Any:
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            public = [n for n in dir(module) if not n.startswith("_")]
            raise config_error(
                where, spec, f"{label} has no function {attr!r}{did_you_mean(attr, public)}"
            )
        obj = getattr(obj, part)
    return obj


def _builtin(where: str, name: str, params: Mapping[str, Any], max_completion_length: int | None):
    cls = BUILTIN_REWARDS[name]
    params = dict(params)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    for key in params:
        if key not in names:
            known = f"its parameters: {', '.join(names)}" if names else "it has no parameters"
            raise ConfigError(
                f"{where}={name!r} is invalid: the built-in {name!r} has no parameter {key!r}"
                f"{did_you_mean(str(key), names)}; {known}"
            )
    if "max_completion_len" in names and "max_completion_len" not in params:
        if max_completion_length is not None:
            params["max_completion_len"] = max_completion_length
    missing = [
        f.name
        for f in dataclasses.fields(cls)
        if f.init
        and f.name not in params
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        example = ", ".join(f"{m}: ..." for m in missing)
        raise ConfigError(
            f"{where}={name!r} is invalid: the built-in {name!r} needs {', '.join(missing)}: "
            f"write {{name: {name}, {example}}}"
        )
    return from_dict(cls, params, where=where)


def load_named(where: str, spec: str) -> Any:
    """The object ``"package.module:name"`` (or ``"package.module.name"``) or
    ``"path/to/file.py:name"`` names (reward functions, tools, environments); ``ConfigError``
    naming ``where`` when it cannot be loaded."""
    if not isinstance(spec, str) or (":" not in spec and "." not in spec):
        raise config_error(where, spec, "write 'package.module:name' or 'path/to/file.py:name'")
    if (parts := reward_file_spec(spec)) is not None:
        module = _load_file(where, spec, parts[0])
        return _attribute(where, spec, module, f"file '{parts[0]}'", parts[1])
    module_name, _, attr = spec.partition(":") if ":" in spec else spec.rpartition(".")
    module = _import(where, spec, module_name)
    return _attribute(where, spec, module, f"module {module_name!r}", attr)


def load_reward_func(
    spec: Any, *, where: str = "reward_funcs", max_completion_length: int | None = None
) -> RewardFunc:
    """The callable an entry names (see the module docstring); ``where`` names the entry in
    errors, ``max_completion_length`` is ``length_penalty``'s default length."""
    check_reward_spec(where, spec)
    if isinstance(spec, Mapping):
        params = dict(spec)
        return _builtin(where, params.pop("name"), params, max_completion_length)
    if not isinstance(spec, str):
        func = spec  # a callable
    elif spec in BUILTIN_REWARDS:
        return _builtin(where, spec, {}, max_completion_length)
    else:
        func = load_named(where, spec)
    if not callable(func):
        raise config_error(where, spec, f"it names a {type(func).__name__}, not a function")
    _check_signature(where, spec, func)
    return func


def _check_signature(where: str, spec: Any, func: Any) -> None:
    """A reward function must take ``**kwargs``: TRL's call passes ``completion_ids``,
    ``trainer_state`` and every dataset column by keyword."""
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):  # some callables have no signature to read
        return
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        raise config_error(
            where,
            spec if not callable(spec) else getattr(spec, "__name__", spec),
            "a reward function must accept **kwargs: it is called as f(prompts=..., "
            "completions=..., completion_ids=..., trainer_state=..., <dataset columns>=...)",
        )


def resolve_reward_funcs(
    specs: Sequence[Any], *, field: str = "reward_funcs", max_completion_length: int | None = None
) -> list[RewardFunc]:
    """``load_reward_func`` of every entry (``field[i]`` in errors); at least one."""
    check_reward_specs(specs, field)
    return [
        load_reward_func(s, where=f"{field}[{i}]", max_completion_length=max_completion_length)
        for i, s in enumerate(specs)
    ]
