"""Config machinery: frozen dataclasses built from YAML dicts, dotted overrides, clear errors.

Every config is a frozen, kw_only dataclass with its validation in ``__post_init__``. Errors are
``ConfigError`` (a ``ValueError``) and name the field, the value and the fix. Unknown keys are
errors that suggest the closest known name; a key a config no longer has (``removed_fields``) is
an error that names what replaced it. A config holds only data: building one touches no device
and runs no user code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import math
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

from jaxrl.runtime.errors import ConfigError

T = TypeVar("T")
# a section's world size is the run's (from the mesh), not a key of its own
WORLD_SIZE_FROM_MESH = types.MappingProxyType(
    {"world_size": "remove it: the data-parallel size comes from mesh.data"}
)
# The learning-rate schedule has one home, ``optimizer`` (the run's stage; the SFT warm start's
# own is ``warm_start.learning_rate`` etc.): an algorithm section's schedule keys are refused
_LR_HOME = "the run's learning-rate schedule is the optimizer section"
_WARM = "the SFT warm start's own is warm_start.{key}"
STAGE_SCHEDULE_FIXES = types.MappingProxyType(
    {
        "learning_rate": (
            f"moved: {_LR_HOME}: set optimizer.learning_rate ({_WARM.format(key='learning_rate')})"
        ),
        "warmup_steps": (
            f"moved: {_LR_HOME}: set optimizer.warmup_steps ({_WARM.format(key='warmup_steps')})"
        ),
        "lr_scheduler_type": (
            f"moved: {_LR_HOME}: set optimizer.decay (constant, cosine or linear; "
            f"{_WARM.format(key='decay')})"
        ),
    }
)


def config_error(field: str, value: Any, fix: str) -> ConfigError:
    """``ConfigError`` with the standard ``field=value: fix`` message."""
    return ConfigError(f"{field}={value!r} is invalid: {fix}")


def require(cond: bool, field: str, value: Any, fix: str) -> None:
    """Raise ``config_error(field, value, fix)`` unless ``cond``."""
    if not cond:
        raise config_error(field, value, fix)


def require_choice(field: str, value: Any, choices: Sequence[Any]) -> None:
    """Raise unless ``value`` is one of ``choices``, listing them."""
    if value not in choices:
        raise config_error(field, value, f"use one of {', '.join(map(repr, choices))}")


def require_batch_fields(cfg: Any) -> None:
    """The batch and length fields a preference section (DPO, KTO) shares."""
    names = ["per_device_train_batch_size", "gradient_accumulation_steps", "world_size"]
    if cfg.world_size is None:  # a run's section before its mesh is known
        names.remove("world_size")
    for name in (*names, "max_length"):
        value = getattr(cfg, name)
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
        require(ok, name, value, "use an integer ≥ 1")
    if cfg.max_prompt_length is not None:
        require(
            1 <= cfg.max_prompt_length < cfg.max_length,
            "max_prompt_length",
            cfg.max_prompt_length,
            f"use 1 ≤ max_prompt_length < max_length ({cfg.max_length}), or leave it unset",
        )


def suggest(name: str, known: Sequence[str]) -> str:
    """A "did you mean ...?" hint naming the closest of ``known``, else all of them."""
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
    return f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(sorted(known))}"


def removed_fields(**fixes: str) -> Callable[[type[T]], type[T]]:
    """Class decorator: keys the config no longer has, each with its fix (the key that replaced
    it, or why to drop it). Setting one, as a keyword argument or as a YAML/dict key
    (``from_dict``), raises ``ConfigError`` ``key=value is invalid: <fix>``."""

    def wrap(cls: type[T]) -> type[T]:
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self: Any, **kwargs: Any) -> None:
            for key, value in kwargs.items():
                if key in fixes:
                    raise config_error(key, value, fixes[key])
            init(self, **kwargs)

        cls.__init__ = __init__  # type: ignore[misc]
        cls.REMOVED_FIELDS = types.MappingProxyType(dict(fixes))  # type: ignore[attr-defined]
        return cls

    return wrap


def file_keys_error(cls: type, key: str, value: Any, where: str) -> ConfigError | None:
    """The error for a key that ``cls`` accepts from Python but not from a config file: one of
    its ``REMOVED_FIELDS``, or of its ``RUN_FIELDS`` (set by the run, e.g. the world size from
    the mesh); None for any other key."""
    for table in ("REMOVED_FIELDS", "RUN_FIELDS"):
        fix = getattr(cls, table, {}).get(key)
        if fix is not None:
            return config_error(where, value, fix)
    return None


@contextlib.contextmanager
def section(where: str) -> Iterator[None]:
    """Prefix the ``ConfigError``s raised inside with the section's key (``grpo.``), as
    ``from_dict(cls, data, where=where)`` does."""
    try:
        yield
    except ConfigError as e:
        if where and not str(e).startswith((where, "unknown config key")):
            raise ConfigError(f"{where}.{e}") from None
        raise


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _coerce(tp: Any, value: Any, where: str) -> Any:
    """Coerce a YAML value to the annotated type, recursing into dataclasses."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{where}: bad value {value!r}")
    if origin is typing.Literal:
        require_choice(where, value, typing.get_args(tp))
        return value
    if _is_dataclass_type(tp):
        if isinstance(tp, type) and isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise config_error(where, value, f"expected a mapping of {tp.__name__} fields")
        return from_dict(tp, value, where=where, section_of_run=True)
    if origin in (tuple, list):
        if isinstance(value, str) or not isinstance(value, Sequence):
            raise config_error(where, value, "expected a list")
        args = typing.get_args(tp)
        item = args[0] if args else Any
        items = [_coerce(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin in (dict, Mapping) or tp is dict:
        if not isinstance(value, Mapping):
            raise config_error(where, value, "expected a mapping")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise config_error(where, value, "expected true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise config_error(where, value, "expected an integer")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "5e-3" (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                raise config_error(where, value, "expected a number") from None
        elif isinstance(value, bool) or not isinstance(value, int | float):
            raise config_error(where, value, "expected a number")
        else:
            number = float(value)
        if not math.isfinite(number):
            raise config_error(where, value, "use a finite number (not inf or nan)")
        return number
    if tp is str:
        if not isinstance(value, str):
            raise config_error(where, value, "expected a string")
        return value
    return value


def from_dict(
    cls: type[T], data: Mapping[str, Any], *, where: str = "", section_of_run: bool = False
) -> T:
    """Build dataclass ``cls`` from a mapping; unknown keys raise with a suggestion.
    ``section_of_run``: ``cls`` is a section of a larger config, which sets the section's
    ``RUN_FIELDS`` (they are None until then)."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        name = f"{where}.{key}" if where else str(key)
        if (error := file_keys_error(cls, key, value, name)) is not None:
            raise error
        if key not in fields:
            raise ConfigError(f"unknown config key {name!r}: {suggest(str(key), list(fields))}")
        kwargs[key] = _coerce(hints[key], value, name)
    if section_of_run:
        kwargs.update(dict.fromkeys(getattr(cls, "RUN_FIELDS", {}), None))
    with section(where):
        return cls(**kwargs)


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain nested dict of a config (tuples become lists), for YAML/JSON dumps that
    ``from_dict`` reads back (a config holds the values given, never resolved ones), without
    its ``RUN_FIELDS``. A function given from Python (a reward function) is written as its
    ``"module:name"``."""

    def plain(v: Any) -> Any:
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            fields = [f.name for f in dataclasses.fields(v) if f.init]
            skip = getattr(v, "RUN_FIELDS", {})
            value = getattr(v, "given", lambda k: getattr(v, k))  # given, never resolved
            return {k: plain(value(k)) for k in fields if k not in skip}
        if isinstance(v, tuple | list):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, types.FunctionType):
            return f"{v.__module__}:{v.__qualname__}"
        return v

    return plain(cfg)


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides (values parsed as YAML) to a nested dict, in place."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.path=value")
        path, raw = item.split("=", 1)
        keys = path.strip().split(".")
        if not all(keys):
            raise ConfigError(f"override {item!r} has an empty key in {path!r}")
        node = data
        for k in keys[:-1]:
            child = node.setdefault(k, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {k!r} is a value, not a section")
            node = child
        try:
            node[keys[-1]] = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as e:
            problem = " ".join(str(getattr(e, "problem", None) or e).split())
            raise ConfigError(
                f"override {item!r}: the value is not valid YAML ({problem}); quote it as a "
                f"string, e.g. {path.strip()}='\"...\"'"
            ) from None
    return data


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that rejects a key given twice in one mapping (YAML keeps the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise ConfigError(
                    f"key {key!r} appears twice in one mapping (lines {seen[key] + 1} and "
                    f"{key_node.start_mark.line + 1}): keep one"
                )
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping from ``path`` with a clear error for missing, empty, malformed or
    duplicate-key files."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    raw = p.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise ConfigError(
            f"config file {str(p)!r} line {line}: byte 0x{raw[e.start]:02x} is not UTF-8; save "
            "the file as UTF-8"
        ) from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader
    except ConfigError as e:
        raise ConfigError(f"config file {str(p)!r}: {e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"config file {str(p)!r}{where}: invalid YAML ({problem})") from None
    if data is None:
        raise ConfigError(
            f"config file {str(p)!r} is empty: start from one of configs/*.yaml (an empty file "
            "would silently run every default)"
        )
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping at top level")
    return data
