"""A tool's JSON schema from its signature and Google-style docstring, as transformers writes it.

The schema is what a chat template's ``tools=`` argument receives: ``{"type": "function",
"function": {"name", "description", "parameters": {"type": "object", "properties", "required"},
"return"?}}``. This is transformers' ``get_json_schema`` (``transformers/utils/
chat_template_utils.py``) reimplemented, so jaxrl needs no transformers at run time; the test
suite checks that both give the same schema for the same functions (docs/tools.md).

Rules: every argument needs a type hint and a description under ``Args:``; ``self``/``cls``
without a hint is skipped (bound methods of an environment); ``int``/``float``/``str``/``bool``/
``None``/``Any``, ``list[...]``, ``tuple[...]``, ``dict[str, ...]``, ``X | Y``, ``Optional``,
``Literal`` and ``Enum`` map to JSON types; a description ending in ``(choices: [...])`` becomes
an ``enum``; the ``Returns:`` block describes the return hint when it converts.
"""

from __future__ import annotations

import inspect
import json
import re
import types
from collections.abc import Callable
from enum import Enum
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

__all__ = ["SchemaError", "get_json_schema"]

_DESCRIPTION = re.compile(r"^(.*?)[\n\s]*(Args:|Returns:|Raises:|\Z)", re.DOTALL)
_ARGS = re.compile(r"\n\s*Args:\n(.*?)[\n\s]*(Returns:|Raises:|\Z)", re.DOTALL)
_ARG_SPLIT = re.compile(
    r"""
(?:^|\n)
([ \t]*)(\w+)(?:[ \t]*\([^()\n]*\))?:\s*
(.*?)\s*
(?=\n(?!\1[ \t])[ \t]*\w+(?:[ \t]*\([^()\n]*\))?:|\Z)
""",
    re.DOTALL | re.VERBOSE,
)
_RETURNS = re.compile(r"\n\s*Returns:\n\s*(.*?)[\n\s]*(Raises:|\Z)", re.DOTALL)
_SCALARS = {int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null"}
_BASIC = {
    int: {"type": "integer"},
    float: {"type": "number"},
    str: {"type": "string"},
    bool: {"type": "boolean"},
    type(None): {"type": "null"},
    list: {"type": "array"},
    tuple: {"type": "array"},
    dict: {"type": "object"},
    Any: {},
}


class SchemaError(ValueError):
    """A tool's signature or docstring cannot be written as a JSON schema."""


def _enum(values: list[Any]) -> dict[str, Any]:
    kinds = list(dict.fromkeys(_SCALARS[type(v)] for v in values))
    return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": values}


def _hint(hint: Any) -> dict[str, Any]:
    origin, args = get_origin(hint), get_args(hint)
    if origin is None and isinstance(hint, type) and issubclass(hint, Enum):
        values = [m.value for m in hint]
        if not values or any(type(v) not in _SCALARS for v in values):
            raise SchemaError(f"the Enum {hint.__name__} needs members with JSON scalar values")
        return _enum(values)
    if origin is None:
        if hint not in _BASIC:
            raise SchemaError(
                f"cannot write the type hint {hint!r} as JSON: use int, float, str, bool, an Enum, "
                "Literal, or list / tuple / dict / Union of those"
            )
        return dict(_BASIC[hint])
    if origin is Union or origin is types.UnionType:
        subtypes = [_hint(t) for t in args if t is not type(None)]
        if len(subtypes) == 1:
            out = subtypes[0]
        elif all(s.keys() == {"type"} and isinstance(s["type"], str) for s in subtypes):
            names = sorted({s["type"] for s in subtypes})
            out = {"type": names[0] if len(names) == 1 else names}
        else:
            out = {"anyOf": subtypes}
        if type(None) in args:
            out["nullable"] = True
        return out
    if origin is Literal and args:
        if any(type(a) not in _SCALARS for a in args):
            raise SchemaError("typing.Literal may list JSON scalars only")
        return _enum(list(args))
    if origin is list:
        return {"type": "array", "items": _hint(args[0])} if args else {"type": "array"}
    if origin is tuple:
        if not args:
            return {"type": "array"}
        if len(args) == 1 or ... in args:
            raise SchemaError(f"the tuple hint {hint} is not supported: use list[...] instead")
        return {"type": "array", "prefixItems": [_hint(t) for t in args]}
    if origin is dict:
        out = {"type": "object"}
        if len(args) == 2:
            out["additionalProperties"] = _hint(args[1])
        return out
    raise SchemaError(f"cannot write the type hint {hint!r} as JSON")


def _parameters(func: Callable[..., Any], name: str) -> dict[str, Any]:
    hints = get_type_hints(func)
    signature = inspect.signature(func)
    first = next(iter(signature.parameters), None)
    implicit = (
        first
        if first in {"self", "cls"}
        and signature.parameters[first].annotation == inspect.Parameter.empty
        else None
    )
    required = []
    for pname, param in signature.parameters.items():
        if pname == implicit:
            continue
        if param.annotation == inspect.Parameter.empty:
            raise SchemaError(f"argument {pname!r} of tool {name!r} has no type hint")
        if param.default == inspect.Parameter.empty:
            required.append(pname)
    properties: dict[str, Any] = {}
    for pname, hint in hints.items():
        if pname == implicit:
            continue
        if pname == "return":
            try:
                properties[pname] = _hint(hint)
            except SchemaError:
                pass
        else:
            properties[pname] = _hint(hint)
    out: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        out["required"] = required
    return out


def get_json_schema(func: Callable[..., Any]) -> dict[str, Any]:
    """``{"type": "function", "function": {...}}`` of ``func`` (module docstring); raises
    ``SchemaError`` naming the tool when its docstring or a type hint cannot be used."""
    name = getattr(func, "__name__", "operation")
    doc = inspect.getdoc(func)
    if not doc:
        raise SchemaError(f"tool {name!r} has no docstring: describe it and each argument (Args:)")
    doc = doc.strip()
    description = m.group(1).strip() if (m := _DESCRIPTION.search(doc)) else None
    args_block = m.group(1) if (m := _ARGS.search(doc)) else None
    returns = m.group(1).strip() if (m := _RETURNS.search(doc)) else None
    described: dict[str, str] = {}
    if args_block is not None:
        lines = "\n".join(line for line in args_block.split("\n") if line.strip())
        described = {
            g[1]: re.sub(r"\s*\n+\s*", " ", g[2].strip()) for g in _ARG_SPLIT.findall(lines)
        }
    schema = _parameters(func, name)
    returned = schema["properties"].pop("return", None)
    if returned is not None and returns is not None:
        returned["description"] = returns
    for arg, prop in schema["properties"].items():
        if arg not in described:
            raise SchemaError(
                f"tool {name!r}: the docstring does not describe argument {arg!r}; add "
                f"'{arg}: <what it is>' under 'Args:'"
            )
        desc = described[arg]
        choices = re.search(r"\(choices:\s*(.*?)\)\s*$", desc, flags=re.IGNORECASE)
        if choices:
            prop["enum"] = [c.strip() if isinstance(c, str) else c for c in json.loads(choices[1])]
            desc = choices.string[: choices.start()].strip()
        prop["description"] = desc
    function = {"name": name, "description": description, "parameters": schema}
    if returned is not None:
        function["return"] = returned
    return {"type": "function", "function": function}
