"""The rollout side of a GRPO run, built in one place: its prompts (``GRPOData``), the generator
and the scorer of the entropy pre-pass, the held-out evaluator (``build_rollout_parts``), and the
``Producer`` that makes one generation (next prompts, dynamic sampling, the batch).

Orchestration only: sampling, rewards and advantages live in ``jaxrl.rollout``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jaxrl.config import ConfigError, GRPOConfig, RunConfig
from jaxrl.data.batching.shared_prompt import SharedPackedBatch
from jaxrl.data.datasets import Dataset
from jaxrl.data.documents import grpo_prompts
from jaxrl.data.tasks import Example
from jaxrl.data.tokenizer import TextTokenizer
from jaxrl.losses.advantages import informative_groups
from jaxrl.rollout.buffer import PromptSampler
from jaxrl.rollout.episodes import EpisodeRunner
from jaxrl.rollout.generator import RolloutGenerator, Sampled
from jaxrl.rollout.heldout import HeldoutEvaluator
from jaxrl.rollout.rewards.builtin import ExactAnswer, exact_answer_reward
from jaxrl.rollout.rewards.compute import RewardFunc, TrainingProgress
from jaxrl.rollout.rewards.specs import resolve_reward_funcs
from jaxrl.rollout.rollout_queue import RolloutBatch, RolloutQueue, RowDocuments
from jaxrl.rollout.tool_eval import EpisodeEvaluator
from jaxrl.rollout.tools.toolbox import Toolbox
from jaxrl.runtime.mesh import make_mesh
from jaxrl.train.score import Scorer
from jaxrl.trainers.preamble import Preamble

__all__ = [
    "DEFAULT_REWARD_FUNCS",
    "GRPOData",
    "Producer",
    "RolloutParts",
    "build_rollout_parts",
    "check_rollout_settings",
    "check_shared_prompt",
    "generation_params",
    "load_reward_funcs",
    "needs_old_logprobs",
    "plan_window",
    "shared_prompt_metrics",
    "snapshot",
]

DEFAULT_REWARD_FUNCS = ("exact_answer", "format")


def load_reward_funcs(
    config: GRPOConfig, given: Sequence[str | RewardFunc] | None = None
) -> list[RewardFunc]:
    """The run's reward functions, loaded and checked (``jaxrl.rollout.rewards.specs``; user
    modules run here): ``given`` (``GRPOTrainer``'s argument), else ``grpo.reward_funcs``, else
    the built-in task's ``DEFAULT_REWARD_FUNCS``."""
    length = config.max_completion_length
    if given:
        return resolve_reward_funcs(given, max_completion_length=length)
    specs = config.reward_funcs or DEFAULT_REWARD_FUNCS
    return resolve_reward_funcs(specs, field="grpo.reward_funcs", max_completion_length=length)


def check_rollout_settings(cfg: RunConfig) -> None:
    """What asynchronous generation (``rollout.max_staleness``) does not do yet."""
    if cfg.rollout.max_staleness and jax.process_count() > 1:
        raise ConfigError(
            f"rollout.max_staleness={cfg.rollout.max_staleness} is single-process for now "
            f"and this run has {jax.process_count()} processes: use rollout.max_staleness=0"
        )
    if cfg.rollout.max_staleness and cfg.grpo.uses_tools:
        raise ConfigError(
            f"rollout.max_staleness={cfg.rollout.max_staleness} does not run tool episodes "
            "yet (grpo.tools / grpo.environment): use rollout.max_staleness=0"
        )


def check_shared_prompt(config: GRPOConfig, model_config: Any) -> None:
    """Shared-prompt packing trains each prompt token once; a MoE load-balance loss counts
    every token it sees, so it would weigh prompts differently: refused."""
    balance = bool(model_config.moe_layers) and model_config.router_aux_loss_coef > 0
    if config.shared_prompt_packing and balance:
        raise ConfigError(
            "grpo.shared_prompt_packing=true is invalid with a MoE load-balance loss "
            f"(router_aux_loss_coef={model_config.router_aux_loss_coef}): it counts every "
            "trained token, and shared prompts are trained once instead of once per "
            "completion; set grpo.shared_prompt_packing=false (or the coefficient to 0)"
        )


def plan_window(
    session: Any, rollouts: RolloutQueue, docs: RowDocuments, *, all_ranks: bool
) -> Any:
    """The step's batch of the window ``docs`` (``session.plan``): one document per row, or
    with ``grpo.shared_prompt_packing`` one prompt copy per row for the completions of one
    generation batch's prompt (``session.plan_shared``, ``jaxrl.data.batching.shared_prompt``)."""
    documents = dict(
        sequences=docs.sequences,
        loss_masks=docs.loss_masks,
        token_fields=docs.token_fields,
        doc_fields={"advantage": docs.advantages},
        all_ranks=all_ranks,
    )
    if not session.cfg.grpo.shared_prompt_packing:
        lengths = [len(x) for x in docs.sequences]
        return session.plan(range(len(docs)), lengths=lengths, **documents)
    return session.plan_shared(
        range(len(docs)),
        prompt_lengths=[int(rollouts.batches[g].prompt_lengths[i]) for g, i in docs.rows],
        group_keys=[g for g, _ in docs.rows],  # shared within a generation batch
        **documents,
    )


def shared_prompt_metrics(packed: Any) -> dict[str, int]:
    """``batch/trained_tokens`` and ``batch/tokens_unshared`` of a shared-prompt batch (the
    tokens the step trained and those the same documents take unshared); {} otherwise."""
    if not isinstance(packed, SharedPackedBatch):
        return {}
    return {
        "batch/trained_tokens": packed.trained_tokens,
        "batch/tokens_unshared": packed.tokens_unshared,
    }


def needs_old_logprobs(cfg: RunConfig) -> bool:
    """Old log-probs when a buffered row may be trained on after an update
    (docs/algorithms/grpo.md §5), or always under docs_per_step (leftover documents wait for
    the next step)."""
    return (
        cfg.grpo.needs_old_logprobs
        or cfg.schedule.docs_per_step > 0
        or cfg.rollout.max_staleness > 0  # generated by older weights
        or cfg.grpo.kl_in_reward  # REINFORCE++'s KL: generating policy vs reference
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


def snapshot(session: Any, mesh: Mesh) -> Any:
    """A copy of the current parameters where generation runs (``mesh``), which later train
    steps (they donate their buffers) leave alone: the asynchronous generations' weights."""
    params = session.policy_params
    if mesh is not session.mesh:
        return jax.device_put(params, replicated(mesh), may_alias=False)
    return jax.tree.map(lambda x: jax.device_put(x, x.sharding, may_alias=False), params)


def generation_params(session: Any, mesh: Mesh) -> Any:
    """The current parameters where the generator's scorer runs (``mesh``): themselves, or a
    copy on the generation devices."""
    if mesh is session.mesh:
        return session.policy_params
    return snapshot(session, mesh)


@dataclasses.dataclass
class GRPOData:
    """A GRPO run's prompts: rows (every column but ``prompt`` goes to the reward functions)
    and prompt ids (chat template and tool schemas applied; over ``grpo.max_prompt_length``
    keep their last tokens, counted in the preamble's report)."""

    train_rows: list[dict]
    train_prompts: list[np.ndarray]
    eval_rows: list[dict]
    eval_prompts: list[np.ndarray]
    columns: list[str]  # the reward functions' extra columns

    @classmethod
    def load(cls, pre: Preamble, config: GRPOConfig, toolbox: Toolbox | None) -> GRPOData:
        cfg = pre.cfg
        limit = config.max_prompt_length or 2**31 - 1
        tools = toolbox.schemas if toolbox is not None else None

        def prompts(split: str, data: Dataset) -> tuple[list[dict], list[np.ndarray]]:
            made = grpo_prompts(data, pre.tokenizer, max_prompt_length=limit, tools=tools)
            pre.report(split, made.report, f"grpo.max_prompt_length={limit}")
            return data.rows, made.ids

        splits = pre.datasets("grpo")
        train_rows, train_prompts = prompts("train", splits["train"])
        eval_rows, eval_prompts = prompts("eval", splits["eval"]) if "eval" in splits else ([], [])
        if any("answer" not in r for r in eval_rows):
            raise ConfigError(
                f"data.eval={cfg.data.eval!r} is invalid for GRPO: held-out accuracy scores "
                "completions against an 'answer' column, which its rows lack; add one "
                "(or leave data.eval out)"
            )
        columns = list(dict.fromkeys(k for r in train_rows for k in r if k != "prompt"))
        data = cls(train_rows, train_prompts, eval_rows, eval_prompts, columns)
        data.check(cfg, config)
        return data

    def check(self, cfg: RunConfig, config: GRPOConfig) -> None:
        """A prompt plus the completion fits one row; a generation's prompts are distinct."""
        longest = max(len(p) for p in self.train_prompts + self.eval_prompts)
        if longest + config.max_completion_length > cfg.schedule.max_tokens:
            raise ConfigError(
                f"schedule.max_tokens={cfg.schedule.max_tokens} is invalid: a prompt of {longest} "
                f"tokens plus grpo.max_completion_length={config.max_completion_length} must "
                "fit one row; raise schedule.max_tokens or lower max_completion_length"
            )
        if config.prompts_per_generation > len(self.train_prompts):
            raise ConfigError(
                f"grpo.generation_batch_size={config.generation.size} is invalid: a "
                f"generation takes {config.prompts_per_generation} prompts (× "
                f"{config.num_generations} completions) but the training data holds "
                f"{len(self.train_prompts)}; lower the batch size or add data"
            )

    def examples(self, split: str) -> list[Example]:
        """The built-in task's problems of ``split`` (notebooks and benchmarks read them)."""
        rows = self.train_rows if split == "train" else self.eval_rows
        return [Example(r["prompt"], r["answer"]) for r in rows]


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
    config, chunk = cfg.grpo, cfg.model.logprob_chunk
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
        log_dir=cfg.output_dir,
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


def replicated(mesh: Mesh) -> jax.sharding.NamedSharding:
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


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
    make = (
        HeldoutEvaluator
        if episodes is None
        else functools.partial(EpisodeEvaluator, runner=episodes)
    )
    return make(
        generator.sampler.config,  # what a sampler runs (LoRA: the merged model)
        tokenizer,
        [r["prompt"] for r in data.eval_rows],
        [r["answer"] for r in data.eval_rows],
        prompt_ids=data.eval_prompts,
        max_new_tokens=cfg.grpo.max_completion_length,
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
    )


class Producer:
    """``producer(params, step)``: the next generation batch, made with ``params`` (the weights
    after ``step`` updates), and its dynamic-sampling stats (``RolloutPipeline``'s produce).

    With ``grpo.dynamic_sampling`` (DAPO) the prompt groups whose rewards all agree (no
    learning signal: ``informative_groups``) are dropped and the next prompts are sampled
    until the batch holds ``generation_batch_size / num_generations`` groups (the first
    ones, in order; the rest are discarded, as DAPO does), at most
    ``max_dynamic_sampling_rounds`` generations; advantages are computed on the final batch.
    """

    def __init__(
        self, cfg: RunConfig, data: GRPOData, generator: RolloutGenerator, prompts: PromptSampler
    ):
        self.config, self.seed, self.max_steps = cfg.grpo, cfg.seed, cfg.max_steps
        self.data, self.generator, self.prompt_sampler = data, generator, prompts

    def __call__(self, params: Any, step: int) -> tuple[RolloutBatch, dict[str, int]]:
        stats: dict[str, int] = {}
        if self.config.dynamic_sampling:
            sampled, stats = self._fill_with_signal(params, step)
        else:
            sampled = self._sample_next(params, step)
        batch = self.generator.build(params, *sampled)
        # the version of the weights that made it (rollout.sync_every may keep an older one)
        made_by = self.generator.sampler.weight_version
        batch.policy_version = step if made_by < 0 else min(step, made_by)
        return batch, stats

    def _sample_next(self, params: Any, step: int) -> Sampled:
        """The next generation's prompts, sampled and scored."""
        n = self.prompt_sampler.generations
        idx = self.prompt_sampler.next_generation()
        rows = [self.data.train_rows[i] for i in idx]
        return self.generator.sample(
            params,
            [self.data.train_prompts[i] for i in idx],
            [r["prompt"] for r in rows],
            {k: [r.get(k) for r in rows] for k in self.data.columns},
            jax.random.fold_in(jax.random.key(self.seed), n),
            TrainingProgress(global_step=step, max_steps=self.max_steps),
        )

    def _fill_with_signal(self, params: Any, step: int) -> tuple[Sampled, dict[str, int]]:
        """DAPO's dynamic sampling: keep drawing generations until enough groups have rewards
        that differ; returns the rows and the rounds and dropped groups (metrics)."""
        c, g = self.config, self.config.num_generations
        need = c.generation.size // g
        parts, kept, dropped = [], 0, 0
        for _ in range(c.max_dynamic_sampling_rounds):
            sampled = self._sample_next(params, step)
            keep_Q = informative_groups(sampled.rewards_BW, g, c.reward_weights)
            parts.append(sampled.rows(np.repeat(keep_Q, g)))
            kept, dropped = kept + int(keep_Q.sum()), dropped + int((~keep_Q).sum())
            if kept >= need:
                break
        else:
            raise ConfigError(
                f"grpo.dynamic_sampling=true: {c.max_dynamic_sampling_rounds} generations "
                f"(grpo.max_dynamic_sampling_rounds) found {kept} of the {need} prompt groups a "
                f"batch needs whose rewards differ ({dropped} groups had identical rewards): the "
                "prompts are too easy or too hard for the model, or the rewards do not vary; "
                "raise grpo.max_dynamic_sampling_rounds, check the reward functions, or set "
                "grpo.dynamic_sampling=false"
            )
        stats = {
            "dynamic_sampling/rounds": len(parts),  # one part per generation
            "dynamic_sampling/dropped_groups": dropped,
        }
        rows = Sampled.concat(parts)
        return rows.rows(np.arange(len(rows.truncated)) < need * g), stats  # first `need` groups
