"""A built-in task that needs a tool: ``a*b=`` with 3-digit operands and a ``calc`` calculator.

A 2-layer character model cannot multiply 3-digit numbers in its head, but it can learn to copy
the problem into a tool call and the tool's answer out of the tool response (docs/tools.md):

    <bos>123*456=<tool_call>{"name":"calc","arguments":{"x":"123*456"}}</tool_call><eos>
    <tool_response>56088</tool_response>56088<eos>

``<tool_call>``, ``</tool_call>``, ``<tool_response>`` and ``</tool_response>`` are single tokens
of the task's character tokenizer (:func:`tool_char_tokenizer`), whose chat template
(:data:`TOOL_CHAT_TEMPLATE`) writes an assistant turn as its content, then its calls in the
Hermes format ``jaxrl.rollout.tools.calls.HermesToolParser`` reads, then ``<eos>``, and a tool
message as ``<tool_response>...</tool_response>``. The template ignores ``tools=`` (the tiny
model needs no tool descriptions); real models' templates list them.

Rows (TRL formats): ``grpo`` → a one-message conversation and its ``answer``; ``sft`` →
``messages`` transcripts, a ``tool_transcripts`` fraction of them calling ``calc`` and the rest
answering directly (so the warm start leaves the policy calling the tool only sometimes, and
GRPO has something to raise).
"""

from __future__ import annotations

import dataclasses
import re
import string
import zlib

import numpy as np

from jaxrl.data.datasets import Dataset, Kind, rows_dataset
from jaxrl.data.tasks import ArithmeticTask
from jaxrl.data.tokenizer import TextTokenizer, char_tokenizer

__all__ = ["CalculatorTask", "TOOL_CHAT_TEMPLATE", "calc", "tool_char_tokenizer"]

TASK_SOURCE = "calculator"
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
# printable ASCII: tool calls are JSON, and error messages reach the model as text
TOOL_ALPHABET = "".join(c for c in string.printable if c not in "\t\r\x0b\x0c")

TOOL_CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{{- m.content or '' -}}"
    "{%- for c in m.tool_calls or [] -%}"
    "{%- set f = c.function if c.function is defined else c -%}"
    '<tool_call>{"name":"{{ f.name }}","arguments":'
    "{%- if f.arguments is string -%}{{ f.arguments }}"
    "{%- else -%}{{ f.arguments | tojson(separators=(',', ':')) }}{%- endif -%}"
    "}</tool_call>"
    "{%- endfor -%}"
    "{{- eos_token -}}"
    "{%- elif m.role == 'tool' -%}"
    "<tool_response>{{ m.content }}</tool_response>"
    "{%- else -%}"
    "{{- m.content -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
)

_PROBLEM = re.compile(r"^\s*(-?\d+)\s*([-+*])\s*(-?\d+)\s*=?\s*$")


def calc(x: str) -> str:
    """Evaluate one integer operation.

    Args:
        x: The operation, e.g. "123*456" (operators + - *)
    """
    m = _PROBLEM.match(x)
    if m is None:
        raise ValueError(f"cannot evaluate {x!r}: write <int><op><int> with op in + - *")
    a, op, b = int(m[1]), m[2], int(m[3])
    return str(a + b if op == "+" else a - b if op == "-" else a * b)


def tool_char_tokenizer() -> TextTokenizer:
    """The character tokenizer of the tool task: printable ASCII, the four tool tokens, and
    :data:`TOOL_CHAT_TEMPLATE`."""
    return char_tokenizer(TOOL_ALPHABET, added_tokens=TOOL_TOKENS, chat_template=TOOL_CHAT_TEMPLATE)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CalculatorTask:
    """``a<op>b=`` problems (``ArithmeticTask``'s draws and splits) solved with ``calc``."""

    min_digits: int = 3
    max_digits: int = 3
    ops: str = "*"
    seed: int = 0
    tool_transcripts: float = 0.5  # fraction of SFT transcripts that call the tool
    alphabet: str = TOOL_ALPHABET

    def __post_init__(self) -> None:
        if not 0 <= self.tool_transcripts <= 1:
            raise ValueError(f"tool_transcripts={self.tool_transcripts}: use a value in [0, 1]")

    def _problems(self, n: int, split: str) -> list[tuple[str, str]]:
        arith = ArithmeticTask(
            min_digits=self.min_digits, max_digits=self.max_digits, ops=self.ops, seed=self.seed
        )
        return [(e.prompt, e.answer) for e in arith.examples(n, split=split)]

    def tokenizer(self) -> TextTokenizer:
        return tool_char_tokenizer()

    def transcript(self, problem: str, answer: str, use_tool: bool) -> list[dict]:
        """The conversation of a solved problem, with or without the tool call."""
        user = {"role": "user", "content": problem}
        if not use_tool:
            return [user, {"role": "assistant", "content": answer}]
        call = {"type": "function", "function": {"name": "calc", "arguments": {"x": problem[:-1]}}}
        return [
            user,
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "calc", "content": calc(problem[:-1])},
            {"role": "assistant", "content": answer},
        ]

    def rows(self, kind: Kind, n: int, *, split: str = "train") -> list[dict]:
        """``grpo``: ``{"prompt": [user message], "answer"}``; ``sft``: ``{"messages"}``
        transcripts, a ``tool_transcripts`` fraction (by a hash of the problem) calling ``calc``
        (held-out transcripts all call it: they measure the tool-using answer)."""
        problems = self._problems(n, split)
        if kind == "grpo":
            return [{"prompt": [{"role": "user", "content": p}], "answer": a} for p, a in problems]
        if kind == "sft":
            rows = []
            for p, a in problems:
                u = np.random.default_rng([self.seed, zlib.crc32(p.encode())]).random()
                use = split == "eval" or u < self.tool_transcripts
                rows.append({"messages": self.transcript(p, a, use)})
            return rows
        raise ValueError(f"the calculator task has no {kind!r} rows: use it with sft or grpo")

    def dataset(self, kind: Kind, n: int, *, split: str = "train") -> Dataset:
        return rows_dataset(self.rows(kind, n, split=split), kind, source=TASK_SOURCE, split=split)
