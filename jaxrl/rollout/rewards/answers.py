"""Final answers of math-style texts: extraction (``\\boxed{}``, ``<answer>``, GSM8K ``####``)
and comparison with numeric normalisation. Pure string functions, used by ``exact_answer``.

Extraction takes, in order: the last ``\\boxed{...}`` (nested braces allowed), else the last
``<answer>...</answer>``, else the text after the last ``####`` (GSM8K; up to the end of that
line), else the whole text; surrounding whitespace is dropped. Both the completion and the
dataset's gold go through it, so a gold that is a whole GSM8K solution ending ``#### 72`` gives
``72``.

With ``fallback="last_number"`` a text with none of those markers gives its last number instead
of the whole text (``"... so she has 18 apples."`` gives ``18``): small instruct models rarely
box their answers, and the whole text then never equals the gold. Off by default (the whole text
is the answer, which the built-in arithmetic task relies on).

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

__all__ = [
    "ANSWER_FALLBACKS",
    "answers_match",
    "extract_answer",
    "last_number",
    "normalize_answer",
    "parse_number",
]

ANSWER_FALLBACKS = ("text", "last_number")  # without a marker: the whole text, or its last number

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_FRAC = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
_INT = r"-?(?:0|[1-9]\d{0,2}(?:,\d{3})+|[1-9]\d*)"  # canonical: no leading zeros
_NUMBER = re.compile(rf"{_INT}(?:\.\d+)?")
_FRACTION = re.compile(rf"({_INT})/([1-9]\d*)")
_IN_TEXT = re.compile(r"(?<![\w.])-?\d+(?:,\d{3})*(?:\.\d+)?(?:/[1-9]\d*)?")  # "-1,234.5", "3/4"


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


def last_number(text: str) -> str | None:
    """The last number written in ``text`` (``-1,234.5``, ``3/4``), None if there is none."""
    found = _IN_TEXT.findall(text)
    return found[-1] if found else None


def extract_answer(text: str, *, fallback: str = "text") -> str:
    """The final answer of a completion or a gold solution (see the module docstring);
    ``fallback`` (``ANSWER_FALLBACKS``) is what a text without a marker gives."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    tags = _ANSWER_TAG.findall(text)
    if tags:
        return tags[-1].strip()
    if "####" in text:
        after = text.rsplit("####", 1)[1].strip()
        return after.splitlines()[0].strip() if after else ""
    if fallback == "last_number":
        number = last_number(text)
        return text.strip() if number is None else number
    if fallback != "text":
        raise ValueError(f"fallback={fallback!r}: use one of {', '.join(ANSWER_FALLBACKS)}")
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


def answers_match(completion: str, gold: str, *, fallback: str = "text") -> bool:
    """The completion's final answer (``fallback`` as in ``extract_answer``) equals the gold's:
    as numbers when both parse, else as normalised text."""
    a = normalize_answer(extract_answer(completion, fallback=fallback))
    b = normalize_answer(extract_answer(gold))
    x, y = parse_number(a), parse_number(b)
    if x is not None and y is not None:
        return x == y
    return a == b
