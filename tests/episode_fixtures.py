"""A tool-call parser and a reward for multi-turn tests with untrained models: every turn calls
``calc`` (so episodes go on whatever the model writes); the reward counts the assistant's
characters."""

from jaxrl.rollout.tools.calls import ParsedTurn, ToolCall


class AlwaysCall:
    """Reads every assistant turn as one call ``calc(x="2*3")``."""

    def parse(self, text: str) -> ParsedTurn:
        return ParsedTurn(text, [ToolCall("calc", {"x": "2*3"})], [])


def chars_reward(completions, **kwargs):
    """The characters the assistant wrote over the whole conversation."""
    return [
        float(sum(len(m["content"]) for m in c if m["role"] == "assistant")) for c in completions
    ]
