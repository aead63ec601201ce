"""Tool calls in a model's text: :class:`ToolCall`, :class:`ParsedTurn` and the parsers.

A parser turns one decoded assistant turn into its content, its well-formed calls and one error
line per malformed block (docs/tools.md). :class:`HermesToolParser` reads the Qwen2.5 / Hermes
format ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; any object with
``parse(text) -> ParsedTurn`` can replace it (``grpo.tool_parser``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["TOOL_PARSERS", "HermesToolParser", "ParsedTurn", "ToolCall", "ToolParser"]


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One parsed call: the tool's name and its keyword arguments."""

    name: str
    arguments: dict[str, Any]

    def message(self) -> dict[str, Any]:
        """The call as an assistant message's ``tool_calls`` entry (transformers / TRL)."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclasses.dataclass(frozen=True)
class ParsedTurn:
    """What a parser found in one assistant turn."""

    content: str  # the text outside tool-call blocks
    calls: list[ToolCall]  # well-formed calls, in order
    errors: list[str]  # one line per malformed block, in order

    def message(self) -> dict[str, Any]:
        """The assistant message of the turn (with ``tool_calls`` when there are any)."""
        out: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.calls:
            out["tool_calls"] = [c.message() for c in self.calls]
        return out


class ToolParser(Protocol):
    def parse(self, text: str) -> ParsedTurn: ...


@dataclasses.dataclass(frozen=True)
class HermesToolParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Qwen2.5, Hermes).

    ``arguments`` may be an object or a string holding one (some templates write it so). The
    content is the text before the first block, stripped (Qwen2.5's template renders content,
    then the calls)."""

    start: str = "<tool_call>"
    end: str = "</tool_call>"

    def parse(self, text: str) -> ParsedTurn:
        calls: list[ToolCall] = []
        errors: list[str] = []
        first = text.find(self.start)
        content = (text if first < 0 else text[:first]).strip()
        at = first
        while at >= 0:
            body_start = at + len(self.start)
            close = text.find(self.end, body_start)
            if close < 0:
                errors.append(f"{self.start} without {self.end}")
                break
            call, error = self._call(text[body_start:close].strip())
            if call is not None:
                calls.append(call)
            else:
                errors.append(error)
            at = text.find(self.start, close + len(self.end))
        return ParsedTurn(content, calls, errors)

    @staticmethod
    def _call(body: str) -> tuple[ToolCall | None, str]:
        try:
            data = json.loads(body)
        except json.JSONDecodeError as e:
            return None, f"the tool call is not valid JSON ({e.msg} at {e.pos}): {body[:80]!r}"
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            return None, f'the tool call needs {{"name": ..., "arguments": {{...}}}}: {body[:80]!r}'
        args = data.get("arguments", data.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        if not isinstance(args, dict):
            return None, f"the arguments of {data['name']!r} must be a JSON object: {body[:80]!r}"
        return ToolCall(data["name"], args), ""


TOOL_PARSERS: dict[str, Callable[[], ToolParser]] = {"hermes": HermesToolParser}
