"""Held-out accuracy of a policy by generation: greedy exact match and sampled accuracy.

GRPO maximises the expected reward of completions sampled at the training temperature, so the
quantity it raises is ``eval/accuracy_sampled``: the exact-answer accuracy of k completions per
held-out prompt, sampled at that temperature, averaged over prompts and samples. What a greedy
decoder then gets is ``eval/accuracy`` (greedy exact match). Both are measured on the same
prompts. GRPO can raise the first a lot while the second barely moves (it sharpens the sampling
distribution towards answers greedy decoding already gives), so a run reports both.

With the run's reward functions (``logging.eval_rewards``) the same completions are also scored
as training scores them: ``eval/reward`` (greedy) and ``eval/reward_sampled`` (k samples) are the
mean of the weighted sum of the rewards (the training ``reward``), ``eval/rewards/<name>/mean``
(and ``.../mean_sampled``) each function's; held-out rows then need no ``answer`` column.

The sampling key is fixed per evaluator: every evaluation draws with the same random bits
(common random numbers), so the change between two evaluations is the policy's, not the dice's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jaxrl.data.documents import prompt_ids as prompt_ids_of
from jaxrl.data.tokenizer import TextTokenizer
from jaxrl.generate.backend import RolloutBackend
from jaxrl.generate.sampler import Sampler, SamplingParams
from jaxrl.losses.advantages import aggregate_rewards
from jaxrl.models.model_config import ModelConfig
from jaxrl.rollout.rewards.builtin import exact_answer_reward
from jaxrl.rollout.rewards.compute import (
    RewardFunc,
    reward_inputs,
    reward_names,
    score_completions,
)

GREEDY = SamplingParams(temperature=0.0)

__all__ = ["GREEDY", "HeldoutEvaluator", "HeldoutResult"]


@dataclasses.dataclass(frozen=True)
class HeldoutResult:
    """One evaluation: greedy and sampled accuracy on the same prompts, plus the raw scores; and
    with the run's reward functions, their means on the same completions."""

    greedy: float | None  # fraction of prompts whose greedy completion is correct; None
    # without answers
    sampled: float | None  # mean correctness over k samples per prompt; None when k = 0
    greedy_correct: np.ndarray | None  # [N] per prompt, 0/1
    sampled_correct: np.ndarray | None  # [N, k] per prompt and sample, 0/1
    greedy_rewards: np.ndarray | None = None  # [N, F] the reward functions' scores (NaN: None)
    sampled_rewards: np.ndarray | None = None  # [N·k, F]
    reward_names: tuple[str, ...] = ()  # the F functions' names
    reward_weights: tuple[float, ...] | None = None  # their weights in ``reward``; None = 1

    def metrics(self, suffix: str = "") -> dict[str, float]:
        """``{"eval/accuracy<suffix>": ..., "eval/accuracy_sampled<suffix>": ...}``, and with
        reward functions ``eval/reward``, ``eval/reward_sampled``, ``eval/rewards/<name>/mean``
        and ``eval/rewards/<name>/mean_sampled``."""
        out = {}
        if self.greedy is not None:
            out[f"eval/accuracy{suffix}"] = self.greedy
        if self.sampled is not None:
            out[f"eval/accuracy_sampled{suffix}"] = self.sampled
        for mode, scores in (("", self.greedy_rewards), ("_sampled", self.sampled_rewards)):
            if scores is None:
                continue
            total = aggregate_rewards(scores, self.reward_weights)
            out[f"eval/reward{mode}{suffix}"] = float(np.nanmean(total))
            for name, column in zip(self.reward_names, scores.T, strict=True):
                out[f"eval/rewards/{name}/mean{mode}{suffix}"] = float(np.nanmean(column))
        return out


class HeldoutEvaluator:
    """Greedy and sampled held-out accuracy of parameters, scored by a correctness reward.

    ``samples_per_prompt`` (k) completions per prompt are drawn with ``sampling`` (the training
    temperature / top-k / top-p); k = 0 measures greedy only. ``reward`` is a TRL-style reward
    function called with the held-out ``answer`` column (completions as messages when the
    prompts are); a completion counts as correct when it returns 1.0. ``answers`` None: no
    accuracy (then ``reward_funcs`` are required). ``reward_funcs``: the run's reward
    functions, called on the same completions as in training (with ``columns``, the held-out
    rows' other columns, and ``completion_ids``; ``reward_timeout`` seconds a call), weighted
    by ``reward_weights`` in ``eval/reward``. ``prompt_ids``: the
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
        answers: Sequence[str] | None,
        *,
        max_new_tokens: int,
        sampling: SamplingParams,
        samples_per_prompt: int,
        seed: int = 0,
        reward: RewardFunc = exact_answer_reward,
        prompt_ids: Sequence[np.ndarray] | None = None,
        mesh: Mesh | None = None,
        sampler: RolloutBackend | None = None,
        reward_funcs: Sequence[RewardFunc] | None = None,
        reward_weights: Sequence[float] | None = None,
        columns: Mapping[str, Sequence[Any]] | None = None,
        reward_timeout: float | None = None,
    ):
        if not prompts or (answers is not None and len(prompts) != len(answers)):
            raise ValueError(
                f"HeldoutEvaluator: need one answer per prompt, got {len(prompts)} prompts and "
                f"{None if answers is None else len(answers)} answers"
            )
        if answers is None and not reward_funcs:
            raise ValueError("HeldoutEvaluator: give answers, reward_funcs, or both")
        for key, values in (columns or {}).items():
            if len(values) != len(prompts):
                raise ValueError(f"column {key!r} has {len(values)} values for {len(prompts)}")
        if samples_per_prompt < 0:
            raise ValueError(f"samples_per_prompt={samples_per_prompt}: use >= 0 (0 = greedy)")
        self.prompts = list(prompts)
        self.answers = None if answers is None else list(answers)
        self.reward_funcs = list(reward_funcs or [])
        self.reward_weights = None if reward_weights is None else tuple(reward_weights)
        self.columns = {k: list(v) for k, v in (columns or {}).items()}
        self.reward_timeout = reward_timeout
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

    def _score(
        self, prompt_ids: list[np.ndarray], repeat: int, s: SamplingParams
    ) -> tuple[np.ndarray | None, np.ndarray | None]:
        """``(correct [B] 0/1 or None, rewards [B, F] or None)`` of one generation."""
        res = self.sampler.generate(prompt_ids, self.key, s)
        ids = res.completions()
        texts = [self.tokenizer.decode(x) for x in ids]
        prompts = [p for p in self.prompts for _ in range(repeat)]
        prompts, completions = reward_inputs(prompts, texts)  # messages for chat prompts
        correct = rewards = None
        if self.answers is not None:
            answers = [a for a in self.answers for _ in range(repeat)]
            scores = self.reward(prompts=prompts, completions=completions, answer=answers)
            correct = (np.asarray(scores, np.float64) == 1.0).astype(np.float64)
        if self.reward_funcs:
            columns = {k: [v for v in vs for _ in range(repeat)] for k, vs in self.columns.items()}
            rewards = score_completions(
                self.reward_funcs,
                prompts,
                completions,
                columns,
                completion_ids=ids,
                timeout=self.reward_timeout,
            )
        return correct, rewards

    def __call__(self, params: Any) -> HeldoutResult:
        """Evaluate ``params`` (an ``nnx.State`` of parameters or a model)."""
        repeated = [p for p in self.prompt_ids for _ in range(self.k)]
        if self.k:  # the sampled call's program compiles while the greedy call runs
            self.sampler.precompile(repeated, key=self.key)
        self.sampler.load_params(params)
        greedy, greedy_rewards = self._score(self.prompt_ids, 1, GREEDY)
        sampled = sampled_rewards = None
        if self.k:
            sampled, sampled_rewards = self._score(repeated, self.k, self.sampling)
            sampled = None if sampled is None else sampled.reshape(-1, self.k)
        return HeldoutResult(
            greedy=None if greedy is None else float(greedy.mean()),
            sampled=None if sampled is None else float(sampled.mean()),
            greedy_correct=greedy,
            sampled_correct=sampled,
            greedy_rewards=greedy_rewards,
            sampled_rewards=sampled_rewards,
            reward_names=tuple(reward_names(self.reward_funcs)),
            reward_weights=self.reward_weights,
        )
