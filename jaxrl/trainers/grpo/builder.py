"""The rollout side of a GRPO-family run, built in one place (``build_rollout_parts``): the
generator, the scorer of the entropy pre-pass, the held-out evaluator and the programs they
compile; ``precompile_start`` compiles the next generation's ahead.

Orchestration only: sampling, rewards and advantages live in ``jaxrl.rollout``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from jaxrl.config import ConfigError, RunConfig
from jaxrl.data.tokenizer import TextTokenizer
from jaxrl.rollout.buffer import PromptSampler
from jaxrl.rollout.episodes import EpisodeRunner
from jaxrl.rollout.generator import RolloutGenerator
from jaxrl.rollout.heldout import HeldoutEvaluator
from jaxrl.rollout.rewards.builtin import ExactAnswer, exact_answer_reward
from jaxrl.rollout.rewards.compute import RewardFunc
from jaxrl.rollout.tool_eval import EpisodeEvaluator
from jaxrl.rollout.tools.toolbox import Toolbox
from jaxrl.runtime import storage
from jaxrl.runtime.mesh import make_mesh, replicated
from jaxrl.train.score import Scorer
from jaxrl.trainers.grpo.data import GRPOData

__all__ = ["RolloutParts", "build_rollout_parts", "precompile_start"]


@dataclasses.dataclass
class RolloutParts:
    """What makes and scores a GRPO run's rollouts."""

    generator: RolloutGenerator
    scorer: Scorer  # the entropy pre-pass: the trainer's parameters, on the trainer's devices
    evaluator: HeldoutEvaluator | EpisodeEvaluator | None  # None: no held-out rows
    generation_mesh: Mesh  # rollout.devices' own, else the trainer's


def build_rollout_parts(
    cfg: RunConfig,
    session: Any,
    tokenizer: TextTokenizer,
    data: GRPOData,
    reward_funcs: Sequence[RewardFunc],
    toolbox: Toolbox | None,
    generation: list,
    *,
    old_logprobs: bool,
) -> RolloutParts:
    """The generator (on ``generation``'s devices when given, else the session's), the scorer
    and the held-out evaluator of a GRPO run whose trainer is ``session``."""
    config, chunk = cfg.stage, cfg.model.logprob_chunk
    mesh = make_mesh(devices=generation) if generation else session.mesh
    ref_params = None
    if config.beta != 0.0:
        # the frozen initial parameters in the compute dtype, a real copy (the step donates its
        # buffers), where generation runs; LoRA: the model, adapters off (docs/precision.md)
        ref_params = session.reference_params()
        if generation:
            ref_params = jax.device_put(ref_params, replicated(mesh))
    episodes = None  # multi-turn episodes with tools (jaxrl.rollout.episodes)
    if toolbox is not None:
        episodes = EpisodeRunner(
            tokenizer,
            toolbox,
            max_turns=config.max_turns,
            max_completion_length=config.max_completion_length,
        )
    generator = RolloutGenerator(
        config,
        session.model_config,
        session.graphdef,
        tokenizer,
        reward_funcs=reward_funcs,
        row_len=cfg.schedule.max_tokens,
        chunk_size=chunk,
        old_logprobs=old_logprobs,
        ref_params=ref_params,
        mesh=mesh,
        episodes=episodes,
        rollout=cfg.rollout,
        # synchronous: the sampler reads the trainer's weights in place (no copy) when
        # they are in the compute dtype; generation overlapping training needs its copy
        copy_params=cfg.rollout.max_staleness > 0,
        log_dir=None if storage.is_remote(cfg.output_dir) else cfg.output_dir,  # a local log
    )
    scorer = generator.scorer
    if generation:
        scorer = Scorer(
            session.graphdef,
            mesh=session.mesh,
            row_len=cfg.schedule.max_tokens,
            temperature=config.temperature,
            chunk_size=chunk,
        )
    evaluator = _evaluator(cfg, session, tokenizer, data, generator, episodes)
    _watch_programs(session, generator, scorer)
    return RolloutParts(generator, scorer, evaluator, mesh)


def _watch_programs(session: Any, generator: RolloutGenerator, scorer: Scorer) -> None:
    """Count the rollout side's compiled programs in the run's ``compiles`` metric; the
    training scorer is the generator's own unless generation has devices of its own."""
    session.programs.add("sampler", generator.sampler)
    session.programs.add("scorer", generator.scorer)
    session.programs.add("training scorer", scorer)


def _evaluator(
    cfg: RunConfig,
    session: Any,
    tokenizer: TextTokenizer,
    data: GRPOData,
    generator: RolloutGenerator,
    episodes: EpisodeRunner | None,
) -> HeldoutEvaluator | EpisodeEvaluator | None:
    """Held-out accuracy over ``data``'s eval rows (None without them)."""
    if not data.eval_rows:
        return None
    with_rewards = cfg.logging.eval_rewards
    if with_rewards and episodes is not None:
        raise ConfigError(
            "logging.eval_rewards=true is invalid with grpo.tools / grpo.environment: held-out "
            "episodes are scored by their final answer (eval/accuracy, eval/tool_call_rate); "
            "set logging.eval_rewards=false"
        )
    answers = (
        [r["answer"] for r in data.eval_rows]
        if all("answer" in r for r in data.eval_rows)
        else None
    )
    extra = {}
    if with_rewards:  # the run's reward functions on the same completions (docs/rewards.md)
        rows = data.eval_rows
        extra = dict(
            reward_funcs=generator.reward_funcs,
            reward_weights=cfg.stage.reward_weights,
            columns={k: [r.get(k) for r in rows] for k in data.columns},
            reward_timeout=cfg.stage.reward_timeout,
        )
    make = (
        HeldoutEvaluator
        if episodes is None
        else functools.partial(EpisodeEvaluator, runner=episodes)
    )
    return make(
        generator.sampler.config,  # what a sampler runs (LoRA: the merged model)
        tokenizer,
        [r["prompt"] for r in data.eval_rows],
        answers,
        prompt_ids=data.eval_prompts,
        max_new_tokens=cfg.stage.max_completion_length,
        sampling=generator.sampler.sampling,
        samples_per_prompt=cfg.logging.eval_samples,
        seed=cfg.seed,
        mesh=session.mesh,
        # synchronous: one sampler, one weight copy; asynchronous: a sampler of its own
        # on the trainer's devices, so evaluations run beside the generation in flight
        sampler=None if cfg.rollout.max_staleness else generator.sampler,
        # held-out accuracy parses answers as the run's exact_answer reward does (its
        # fallback included); the strict default otherwise
        reward=next(
            (f for f in generator.reward_funcs if isinstance(f, ExactAnswer)),
            exact_answer_reward,
        ),
        **extra,
    )


def precompile_start(
    session: Any, generator: RolloutGenerator, data: GRPOData, prompts: PromptSampler
) -> None:
    """At a run's start (or resume): the next generation's engine program
    (``Sampler.precompile``), then the train-step programs a previous run of this config
    compiled (``Session.precompile_steps``), compiled on the background thread while the start
    evaluation and the first weight copy run."""
    ahead = copy.deepcopy(prompts)  # the next prompts, not taken
    generator.precompile([data.train_prompts[i] for i in ahead.next_generation()])
    session.precompile_steps()
