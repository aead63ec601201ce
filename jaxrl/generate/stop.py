"""Stop strings as a token-level automaton the decode loop runs on the device.

A completion stops at the first token whose text completes one of the stop strings (TRL's /
vLLM's ``stop``), matched on the completion's text (the prompt is not part of it). The token
that completes the match is kept (its log-prob is part of the sample); nothing after it is
generated. The check runs inside the compiled decode loop, so a stopped slot is refilled at once.

Construction (host, once per sampler). The states are the prefixes of the stop strings; the
state after some text is its longest suffix that is such a prefix (Aho-Corasick), so a stop
string ends at the current character exactly when it is a suffix of the state. Reading a whole
token's text from each state gives ``transitions [Z, V]``: the next state, or ``MATCHED`` (-1)
when a stop string ends anywhere inside the token. On the device a step is one gather,
``transitions[state_B, token_B]``. Tokens that contain no character of any stop string send
every state to the empty prefix and never match; they are filled in without a scan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

MATCHED = -1

__all__ = ["MATCHED", "StopStrings"]


@dataclasses.dataclass(frozen=True, eq=False)
class StopStrings:
    """The automaton of ``strings`` over a vocabulary (``transitions`` int32 ``[Z, V]``)."""

    strings: tuple[str, ...]
    transitions: np.ndarray  # int32 [Z, V]: next state after the token's text, MATCHED = stop

    @classmethod
    def build(cls, strings: Sequence[str], token_texts: Sequence[str]) -> StopStrings:
        """``token_texts[v]``: the text token v decodes to on its own."""
        strings = tuple(strings)
        if not strings or any(not isinstance(s, str) or not s for s in strings):
            raise ValueError(f"stop strings {strings!r}: give non-empty strings")
        prefixes = sorted({s[:i] for s in strings for i in range(len(s) + 1)}, key=len)
        index = {p: z for z, p in enumerate(prefixes)}
        chars = set("".join(strings))

        def step(state: str, c: str) -> str:
            text = state + c
            for start in range(len(text) + 1):  # the longest suffix that is a prefix
                if text[start:] in index:
                    return text[start:]
            return ""

        table = np.zeros((len(prefixes), len(token_texts)), np.int32)
        for v, text in enumerate(token_texts):
            if chars.isdisjoint(text):
                continue  # every state → "" and no match
            for z, state in enumerate(prefixes):
                for c in text:
                    state = step(state, c)
                    if any(state.endswith(s) for s in strings):
                        table[z, v] = MATCHED
                        break
                else:
                    table[z, v] = index[state]
        return cls(strings, table)

    @classmethod
    def from_decode(
        cls, strings: Sequence[str], decode: Callable[[list[int]], str], vocab_size: int
    ) -> StopStrings:
        """Token texts from a tokenizer's ``decode`` of each id alone (e.g.
        ``lambda ids: tok.decode(ids, stop_at_eos=False)``)."""
        return cls.build(strings, [decode([v]) for v in range(vocab_size)])

    @property
    def num_states(self) -> int:
        return int(self.transitions.shape[0])
