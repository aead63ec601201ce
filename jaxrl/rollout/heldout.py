"""Held-out accuracy of a policy by generation: greedy exact match and sampled accuracy.

GRPO maximises the expected reward of completions sampled at the training temperature, so the
quantity it raises is ``eval/accuracy_sampled``: the exact-answer accuracy of k completions per
held-out prompt, sampled at that temperature, averaged over prompts and samples. What a greedy
decoder then gets is ``eval/accuracy`` (greedy exact match). Both are measured on the same
prompts. GRPO can raise the first a lot while the second barely moves (it sharpens the sampling
distribution towards answers greedy decoding already gives), so a run reports both.

The sampling key is fixed per evaluator: every evaluation draws with the same random bits
(common random numbers), so the change between two evaluations is the policy's, not the dice's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jaxrl.data.documents import prompt_ids as prompt_ids_of
from jaxrl.data.tokenizer import TextTokenizer
from jaxrl.generate.backend import RolloutBackend
from jaxrl.generate.sampler import Sampler, SamplingParams
from jaxrl.models.model_config import ModelConfig
from jaxrl.rollout.rewards.builtin import exact_answer_reward
from jaxrl.rollout.rewards.compute import RewardFunc, reward_inputs

GREEDY = SamplingParams(temperature=0.0)

__all__ = ["GREEDY", "HeldoutEvaluator", "HeldoutResult"]


@dataclasses.dataclass(frozen=True)
class HeldoutResult:
    """One evaluation: greedy and sampled accuracy on the same prompts, plus the raw scores."""

    greedy: float  # fraction of prompts whose greedy completion is correct
    sampled: float | None  # mean correctness over k samples per prompt; None when k = 0
    greedy_correct: np.ndarray  # [N] per prompt, 0/1
    sampled_correct: np.ndarray | None  # [N, k] per prompt and sample, 0/1

    def metrics(self, suffix: str = "") -> dict[str, float]:
        """``{"eval/accuracy<suffix>": ..., "eval/accuracy_sampled<suffix>": ...}``."""
        out = {f"eval/accuracy{suffix}": self.greedy}
        if self.sampled is not None:
            out[f"eval/accuracy_sampled{suffix}"] = self.sampled
        return out


class HeldoutEvaluator:
    """Greedy and sampled held-out accuracy of parameters, scored by a correctness reward.

    ``samples_per_prompt`` (k) completions per prompt are drawn with ``sampling`` (the training
    temperature / top-k / top-p); k = 0 measures greedy only. ``reward`` is a TRL-style reward
    function called with the held-out ``answer`` column (completions as messages when the
    prompts are); a completion counts as correct when it returns 1.0. ``prompt_ids``: the
    prompts' token ids (default: ``jaxrl.data.documents.prompt_ids`` of each prompt).
    ``mesh``: split the prompts over its batch axes (``Sampler``); the random bits, hence the
    result, do not depend on it. ``sampler``: an existing sampler to share (GRPO's,
    so the run holds one compute-dtype copy of the weights, not two).
    """

    def __init__(
        self,
        model_config: ModelConfig,
        tokenizer: TextTokenizer,
        prompts: Sequence[str],
        answers: Sequence[str],
        *,
        max_new_tokens: int,
        sampling: SamplingParams,
        samples_per_prompt: int,
        seed: int = 0,
        reward: RewardFunc = exact_answer_reward,
        prompt_ids: Sequence[np.ndarray] | None = None,
        mesh: Mesh | None = None,
        sampler: RolloutBackend | None = None,
    ):
        if len(prompts) != len(answers) or not prompts:
            raise ValueError(
                f"HeldoutEvaluator: need one answer per prompt, got {len(prompts)} prompts and "
                f"{len(answers)} answers"
            )
        if samples_per_prompt < 0:
            raise ValueError(f"samples_per_prompt={samples_per_prompt}: use >= 0 (0 = greedy)")
        self.prompts, self.answers = list(prompts), list(answers)
        if prompt_ids is None:  # text prompts, tokenised as every trainer tokenises a prompt
            prompt_ids = [np.asarray(prompt_ids_of(tokenizer, p), np.int32) for p in prompts]
        self.prompt_ids = list(prompt_ids)
        self.tokenizer = tokenizer
        self.k = samples_per_prompt
        self.sampling = sampling
        self.key = jax.random.key(seed)
        self.reward = reward
        # a GRPO run shares its generation sampler: one compute-dtype copy of the weights
        self.sampler: RolloutBackend = sampler or Sampler(
            model_config,
            max_new_tokens=max_new_tokens,
            eos_id=tokenizer.eos_id,
            pad_id=tokenizer.pad_id,
            sampling=sampling,
            mesh=mesh,
        )

    def _correct(self, prompt_ids: list[np.ndarray], repeat: int, s: SamplingParams) -> np.ndarray:
        res = self.sampler.generate(prompt_ids, self.key, s)
        texts = [self.tokenizer.decode(x) for x in res.completions()]
        prompts = [p for p in self.prompts for _ in range(repeat)]
        answers = [a for a in self.answers for _ in range(repeat)]
        prompts, completions = reward_inputs(prompts, texts)  # messages for chat prompts
        scores = self.reward(prompts=prompts, completions=completions, answer=answers)
        return (np.asarray(scores, np.float64) == 1.0).astype(np.float64)

    def __call__(self, params: Any) -> HeldoutResult:
        """Evaluate ``params`` (an ``nnx.State`` of parameters or a model)."""
        repeated = [p for p in self.prompt_ids for _ in range(self.k)]
        if self.k:  # the sampled call's program compiles while the greedy call runs
            self.sampler.precompile(repeated, key=self.key)
        self.sampler.load_params(params)
        greedy = self._correct(self.prompt_ids, 1, GREEDY)
        sampled = None
        if self.k:
            sampled = self._correct(repeated, self.k, self.sampling).reshape(-1, self.k)
        return HeldoutResult(
            greedy=float(greedy.mean()),
            sampled=None if sampled is None else float(sampled.mean()),
            greedy_correct=greedy,
            sampled_correct=sampled,
        )
