"""Config machinery: frozen dataclasses built from YAML dicts, dotted overrides, clear errors.

Every config is a frozen, kw_only dataclass with its validation in ``__post_init__``. Errors are
``ConfigError`` (a ``ValueError``) and name the field, the value and the fix. Unknown keys are
errors that suggest the closest known name.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

from jaxrl.runtime.errors import ConfigError

T = TypeVar("T")


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


def suggest(name: str, known: Sequence[str]) -> str:
    """A "did you mean ...?" hint naming the closest of ``known``, else all of them."""
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
    return f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(sorted(known))}"


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
        return from_dict(tp, value, where=where)
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


def from_dict(cls: type[T], data: Mapping[str, Any], *, where: str = "") -> T:
    """Build dataclass ``cls`` from a mapping; unknown keys raise with a suggestion."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        name = f"{where}.{key}" if where else str(key)
        if key not in fields:
            raise ConfigError(f"unknown config key {name!r}: {suggest(str(key), list(fields))}")
        kwargs[key] = _coerce(hints[key], value, name)
    try:
        return cls(**kwargs)
    except ConfigError as e:
        if where and not str(e).startswith((where, "unknown config key")):
            raise ConfigError(f"{where}.{e}") from None
        raise


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain nested dict of a config (tuples become lists), for YAML/JSON dumps."""

    def plain(v: Any) -> Any:
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v) if f.init}
        if isinstance(v, tuple | list):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
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
        node[keys[-1]] = yaml.safe_load(raw) if raw.strip() else None
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
