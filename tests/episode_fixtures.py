"""A tool-call parser and a reward for multi-turn tests with untrained models: every turn calls
``calc`` (so episodes go on whatever the model writes); the reward counts the assistant's
characters; an engine behind the bare rollout interface (the re-sending path)."""

from jaxrl.generate.backend import RolloutBackend
from jaxrl.generate.sampler import Sampler
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


class Resend(RolloutBackend):
    """``sampler`` behind the bare rollout interface: no ``session`` (the default, None), so
    episodes re-send each conversation, as through a remote backend; ``calls`` counts them."""

    def __init__(self, sampler: Sampler):
        self.sampler = sampler
        self.config, self.sampling = sampler.config, sampler.sampling
        self.max_new_tokens = sampler.max_new_tokens
        self.calls = 0

    @property
    def weight_version(self) -> int:
        return self.sampler.weight_version

    def generate(self, prompts, key, sampling=None, *, max_tokens=None):
        self.calls += 1
        return self.sampler.generate(prompts, key, sampling, max_tokens=max_tokens)

    def load_params(self, params, *, copy=None, version=None):
        self.sampler.load_params(params, copy=copy, version=version)

    def memory_bytes(self, num_requests, num_groups, longest_prompt):
        return self.sampler.memory_bytes(num_requests, num_groups, longest_prompt)
