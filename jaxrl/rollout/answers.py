"""Final answers of math-style texts: extraction (``\\boxed{}``, ``<answer>``, GSM8K ``####``)
and comparison with numeric normalisation. Pure string functions, used by ``exact_answer``.

Extraction takes, in order: the last ``\\boxed{...}`` (nested braces allowed), else the last
``<answer>...</answer>``, else the text after the last ``####`` (GSM8K; up to the end of that
line), else the whole text; surrounding whitespace is dropped. Both the completion and the
dataset's gold go through it, so a gold that is a whole GSM8K solution ending ``#### 72`` gives
``72``.

Normalisation: ``$`` signs, LaTeX thin spaces (``\\,`` ``\\!``), ``{,}``, a trailing full stop
and a trailing percent sign (``%`` or ``\\%``: ``75%`` equals ``75``, as GSM8K's golds carry
none) are removed, and ``\\frac{a}{b}`` (``\\dfrac``, ``\\tfrac``) becomes ``a/b``. Then two
answers that are both numbers compare as exact rationals: ``1,234`` = ``1234`` = ``1234.0``,
``3/4`` = ``0.75``. A number must be written canonically: thousands groups of exactly three
digits, no leading zeros (``0.5`` is a number, ``05``, ``-0`` and ``+5`` are not), so that
anything else compares as text, exactly. That keeps the built-in arithmetic task's answers
(reversed digits, where ``02`` and ``2`` differ) scored as before: exact text after stripping.
"""

from __future__ import annotations

import re
from fractions import Fraction

__all__ = ["answers_match", "extract_answer", "normalize_answer", "parse_number"]

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_FRAC = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
_INT = r"-?(?:0|[1-9]\d{0,2}(?:,\d{3})+|[1-9]\d*)"  # canonical: no leading zeros
_NUMBER = re.compile(rf"{_INT}(?:\.\d+)?")
_FRACTION = re.compile(rf"({_INT})/([1-9]\d*)")


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces matched; None if none
    is complete."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def extract_answer(text: str) -> str:
    """The final answer of a completion or a gold solution (see the module docstring)."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    tags = _ANSWER_TAG.findall(text)
    if tags:
        return tags[-1].strip()
    if "####" in text:
        after = text.rsplit("####", 1)[1].strip()
        return after.splitlines()[0].strip() if after else ""
    return text.strip()


def normalize_answer(answer: str) -> str:
    """``answer`` without currency/percent signs, LaTeX spacing and a trailing full stop."""
    s = answer.strip()
    s = _FRAC.sub(r"\1/\2", s)
    s = s.replace("{,}", ",")
    for token in ("\\$", "$", "\\,", "\\!"):
        s = s.replace(token, "")
    s = s.strip()
    s = s.removesuffix(".").rstrip()
    if s.endswith("\\%"):
        s = s[:-2].rstrip()
    elif s.endswith("%"):
        s = s[:-1].rstrip()
    return s


def parse_number(answer: str) -> Fraction | None:
    """The exact value of a canonically written number or fraction, else None."""
    if _NUMBER.fullmatch(answer):
        value = Fraction(answer.replace(",", ""))
        return None if answer.startswith("-") and value == 0 else value  # "-0" is not canonical
    m = _FRACTION.fullmatch(answer)
    if m:
        return Fraction(int(m.group(1).replace(",", "")), int(m.group(2)))
    return None


def answers_match(completion: str, gold: str) -> bool:
    """The completion's final answer equals the gold's: as numbers when both parse, else as
    normalised text."""
    a = normalize_answer(extract_answer(completion))
    b = normalize_answer(extract_answer(gold))
    x, y = parse_number(a), parse_number(b)
    if x is not None and y is not None:
        return x == y
    return a == b
