"""Chat templates rendered exactly as ``transformers`` renders them, and assistant-token masks.

A chat template is a Jinja program stored with a tokenizer (``tokenizer_config.json``'s
``chat_template``, or ``chat_template.jinja``). ``transformers`` compiles it in an
``ImmutableSandboxedEnvironment`` with ``trim_blocks``, ``lstrip_blocks`` and the
``loopcontrols`` extension, a ``tojson`` filter that does not escape HTML, and the globals
``raise_exception``, ``strftime_now``, ``dict`` and ``namespace``; it renders with ``messages``,
``tools``, ``documents``, ``add_generation_prompt``, the tokenizer's named special tokens
(``bos_token``, ``eos_token``, ...) and any extra keyword, after dropping message keys whose value
is None. The rendered text is tokenised with no special tokens added (the template writes them).
This module reproduces that (``transformers/utils/chat_template_utils.py``), so
``TextTokenizer.apply_chat_template`` gives the same ids as ``AutoTokenizer`` for the same
directory (docs/data.md).

The assistant mask (SFT on assistant turns only) is found without ``{% generation %}`` tags: the
conversation is rendered turn by turn, ``messages[:i]`` with a generation prompt against
``messages[:i + 1]`` without, and the tokens between the two belong to assistant turn ``i``. That
needs the *prefix property*: every such render is a token prefix of the full conversation's.
Templates that rewrite earlier turns (e.g. dropping past reasoning) break it, and get an error.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

Message = Mapping[str, Any]

__all__ = ["ChatTemplateError", "Template", "assistant_mask", "compile_template"]


class ChatTemplateError(ValueError):
    """A chat template is missing, fails to render, or cannot give an assistant mask."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # transformers' filter: Jinja's own escapes HTML characters, which templates must not see
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """``dict`` for templates, without attribute access to the real type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """``namespace`` that refuses underscore-prefixed attributes (as transformers does)."""

    def __init__(*args: Any, **kwargs: Any):  # noqa: N805 - Jinja's signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes, got {name!r}"
            )


class _GenerationTags(jinja2.ext.Extension):
    """Accept ``{% generation %}...{% endgeneration %}`` (TRL's assistant-mask tags) and render
    the body unchanged; the mask here comes from prefix renders instead."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


@functools.lru_cache(maxsize=16)
def _environment_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTags, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    return env.from_string(source)


def _plain(value: Any) -> Any:
    """JSON-like data only (what transformers lets a template see); other objects become a
    placeholder naming their type."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if hasattr(value, "item") and callable(value.item) and getattr(value, "shape", None) == ():
        return _plain(value.item())  # numpy scalars
    return f"<{type(value).__name__}>"


@dataclasses.dataclass(frozen=True)
class Template:
    """One chat template: its Jinja source, where it came from (for errors), and the named
    special tokens it sees (``bos_token``, ``eos_token``, ...)."""

    source: str  # the Jinja text
    origin: str  # e.g. "models/x/tokenizer_config.json (chat_template)"
    special_tokens: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def render(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The conversation as text, as ``tokenizer.apply_chat_template(..., tokenize=False)``."""
        if not messages:
            raise ChatTemplateError("cannot apply a chat template to an empty conversation")
        chat = []
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping):
                raise ChatTemplateError(
                    f"message {i} must be a {{role, content}} mapping, got {type(message).__name__}"
                )
            chat.append(_plain({k: v for k, v in message.items() if v is not None}))
        context = {**self.special_tokens, **_plain(dict(template_kwargs))}
        try:
            return _environment_template(self.source).render(
                messages=chat,
                tools=_plain(list(tools)) if tools is not None else None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **context,
            )
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"the chat template of {self.origin} failed: {e}") from None


def compile_template(source: str) -> None:
    """Parse a template now, so a syntax error is reported where the tokenizer is loaded."""
    _environment_template(source)


def assistant_mask(
    encode_chat: Callable[..., list[int]],
    messages: Sequence[Message],
    *,
    eos_id: int | None,
    origin: str,
) -> tuple[list[int], list[int]]:
    """``(ids, mask)`` of a whole conversation; ``mask[t] = 1`` on tokens of assistant turns.

    ``encode_chat(messages, add_generation_prompt=...)`` renders and tokenises. Assistant turn i
    spans from the end of ``messages[:i]`` rendered with a generation prompt to the end of
    ``messages[:i + 1]``; the span stops after its last ``eos_id`` (the end-of-turn token, e.g.
    ``<|im_end|>``) so separators the template writes after it (a newline) carry no loss.
    Raises ``ChatTemplateError`` naming the template and the turn when a partial render is not
    a token prefix of the full one.
    """
    ids = encode_chat(messages, add_generation_prompt=False)
    mask = [0] * len(ids)
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        if i == 0:
            raise ChatTemplateError(
                "the conversation starts with an assistant turn: there is no prompt to condition "
                "it on; start with a user (or system) message"
            )
        before = encode_chat(messages[:i], add_generation_prompt=True)
        after = encode_chat(messages[: i + 1], add_generation_prompt=False)
        for name, part in (("before", before), ("through", after)):
            if ids[: len(part)] != part:
                what = (
                    f"messages[:{i}] + generation prompt"
                    if name == "before"
                    else (f"messages[:{i + 1}]")
                )
                raise ChatTemplateError(
                    f"the chat template of {origin} does not render conversations "
                    f"incrementally: {what} is not a token prefix of the whole conversation "
                    f"(assistant turn {i}), so the assistant tokens cannot be located. Set "
                    "sft.completion_only_loss=false to train on every token, or use "
                    "prompt/completion rows"
                )
        span = after[len(before) :]
        end = len(after)
        if eos_id is not None and eos_id in span:
            end = len(before) + len(span) - span[::-1].index(eos_id)
        for t in range(len(before), end):
            mask[t] = 1
    return ids, mask
