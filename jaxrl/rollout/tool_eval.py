"""Held-out accuracy of a tool-using policy: ``HeldoutEvaluator`` with episodes for completions.

Each held-out prompt runs a whole episode (``jaxrl.rollout.episodes``): greedy for
``eval/accuracy``, and ``logging.eval_samples`` sampled episodes per prompt at the training
temperature for ``eval/accuracy_sampled``, scored by the final answer; ``eval/tool_call_rate``
and ``eval/tool_call_rate_sampled`` are the fractions of those episodes that call a tool. Keys
are fixed per evaluator
(``episode_key(key, row, turn)``), so two evaluations draw the same random bits.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxrl.generate.sampler import SamplingParams
from jaxrl.rollout.episodes import EpisodeRunner
from jaxrl.rollout.heldout import GREEDY, HeldoutEvaluator, HeldoutResult

__all__ = ["EpisodeEvaluator", "EpisodeHeldoutResult"]


@dataclasses.dataclass(frozen=True)
class EpisodeHeldoutResult(HeldoutResult):
    """``HeldoutResult`` plus the tool-call rates of the greedy and the sampled episodes."""

    tool_call_rate: float = 0.0
    tool_call_rate_sampled: float | None = None

    def metrics(self, suffix: str = "") -> dict[str, float]:
        out = {**super().metrics(suffix), f"eval/tool_call_rate{suffix}": self.tool_call_rate}
        if self.tool_call_rate_sampled is not None:
            out[f"eval/tool_call_rate_sampled{suffix}"] = self.tool_call_rate_sampled
        return out


class EpisodeEvaluator(HeldoutEvaluator):
    """``HeldoutEvaluator`` whose completions are tool episodes run by ``runner``."""

    def __init__(self, *args: Any, runner: EpisodeRunner, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.runner = runner
        self._calls: dict[bool, list[int]] = {}  # greedy? → tool calls per episode

    def _score(
        self, prompt_ids: list[np.ndarray], repeat: int, s: SamplingParams
    ) -> tuple[np.ndarray, None]:
        """(correct per episode, no reward-function scores: episodes are scored by the final
        answer alone)."""
        prompts = [p for p in self.prompts for _ in range(repeat)]
        answers = [a for a in self.answers for _ in range(repeat)]
        rows = [{"answer": a} for a in answers]
        eps = self.runner.run(self.sampler, prompt_ids, prompts, rows, self.key, s)
        self._calls[s is GREEDY] = [e.tool_calls for e in eps]
        completions = [e.messages for e in eps]
        scores = self.reward(prompts=prompts, completions=completions, answer=answers)
        return (np.asarray(scores, np.float64) == 1.0).astype(np.float64), None

    def __call__(self, params: Any) -> EpisodeHeldoutResult:
        self._calls = {}
        result = super().__call__(params)
        rate = {k: float(np.mean(np.asarray(v) > 0)) for k, v in self._calls.items()}
        return EpisodeHeldoutResult(
            **dataclasses.asdict(result),
            tool_call_rate=rate[True],
            tool_call_rate_sampled=rate.get(False),
        )
