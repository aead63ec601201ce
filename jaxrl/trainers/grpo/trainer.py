"""GRPO-family trainers (GRPO / GSPO / DAPO / Dr.GRPO; PPO with its critic stage): sampler →
rewards → row queue → exact engine.

Per generation (as in TRL): the next prompts in TRL ``RepeatSampler`` order → ``RolloutGenerator``
(weights synced from the trainer, KV-cache sampling, rewards, advantages on the whole batch, each
row's document, old / reference log-probs when needed) → the ``RolloutQueue``, which holds every
row until it is trained on (the generation buffer inside it serves them). Per optimizer step: the
window's documents (the micro-steps ``MicroStepRule`` says make a step) → ``build_dp_schedule``
as one step → packed ``[R, M, T]`` batch → the train step with the stage's objective, then the
stage's own step (``Stage``). Generations come from the ``RolloutPipeline`` (made when taken, or
ahead with ``rollout.max_staleness``)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxrl.config import STAGE_SECTIONS, RunConfig
from jaxrl.data.batching.step_plan import StepBatch
from jaxrl.rollout.buffer import MicroStepRule, PromptSampler
from jaxrl.rollout.pipeline import RolloutPipeline
from jaxrl.rollout.rewards.compute import RewardFunc
from jaxrl.rollout.rollout_queue import RolloutBatch, RolloutQueue
from jaxrl.rollout.tools.toolbox import toolbox_from_config
from jaxrl.runtime.mesh import reserve_devices, run_devices
from jaxrl.train.run_io.metrics import read_metrics
from jaxrl.train.run_io.plots import plot_reward_and_accuracy
from jaxrl.trainers.algorithm import RLStage, WarmStart
from jaxrl.trainers.counters import ZeroSpreadWatch, empty_cause
from jaxrl.trainers.external_rollouts import external_batch
from jaxrl.trainers.grpo.builder import build_rollout_parts, precompile_start
from jaxrl.trainers.grpo.checks import check_rollout_settings, check_shared_prompt
from jaxrl.trainers.grpo.data import GRPOData
from jaxrl.trainers.grpo.metrics import shared_prompt_metrics, staleness_metrics
from jaxrl.trainers.grpo.placement import generation_params, snapshot
from jaxrl.trainers.grpo.planning import plan_window
from jaxrl.trainers.grpo.producer import Producer
from jaxrl.trainers.grpo.rewards import load_reward_funcs
from jaxrl.trainers.grpo.stage import Stage
from jaxrl.trainers.preamble import Preamble
from jaxrl.trainers.session import generation_devices, with_device_ranks

__all__ = ["PLOT_NAME", "GRPOTrainer", "RolloutTrainer"]

PLOT_NAME = "grpo_progress.png"


class RolloutTrainer(RLStage):
    """The GRPO family's trainer: GRPO's rollouts and the policy's step, composed with a
    ``stage`` (its objective, and what it trains beside the policy); ``run()`` trains
    ``max_steps`` and returns a summary. ``GRPOTrainer`` and ``PPOTrainer`` are its kinds."""

    description = "grpo"

    def __init__(
        self,
        cfg: RunConfig,
        *,
        reward_funcs: Sequence[str | RewardFunc] | None = None,
        stage: Stage,
    ):
        self.stage = stage
        cfg = with_device_ranks(cfg)
        check_rollout_settings(cfg)
        # rollout.max_staleness >= 1: the last devices generate, the others train
        with reserve_devices(generation_devices(cfg, len(run_devices()))) as generation:
            self._build(cfg, reward_funcs, generation)

    @classmethod
    def for_run(cls, cfg: RunConfig, warm_start: WarmStart) -> RolloutTrainer:
        """The reward functions loaded (user code) and checked before the warm start."""
        cfg = with_device_ranks(cfg)
        funcs = load_reward_funcs(cfg.stage, section=STAGE_SECTIONS[cfg.algorithm])
        return cls(warm_start(cfg), reward_funcs=funcs)

    def _build(
        self, cfg: RunConfig, reward_funcs: Sequence[str | RewardFunc] | None, generation: list
    ) -> None:
        funcs = load_reward_funcs(cfg.stage, reward_funcs, section=STAGE_SECTIONS[cfg.algorithm])
        pre = Preamble(cfg)
        self.cfg, self.config, self.tokenizer = pre.cfg, pre.cfg.stage, pre.tokenizer
        # tools / environment (docs/tools.md): loaded now, their schemas go into the prompts
        toolbox = toolbox_from_config(self.config) if self.config.uses_tools else None
        if toolbox is not None:  # an environment's get_reward() is a reward (TRL)
            funcs = [*funcs, *toolbox.reward_funcs()]
        self.data = data = GRPOData.load(pre, self.config, toolbox)
        self.data_report = pre.data_report  # prompts the length limit cut
        builtin = self.cfg.data.train is None  # the task's problems (notebooks, benchmarks)
        self.train_examples = data.examples("train") if builtin else None
        self.eval_examples = data.examples("eval") if builtin else None
        self.session = pre.session(self.stage.objective(self.cfg))
        check_shared_prompt(self.config, self.session.model_config)
        self.computes_old_logprobs = self.stage.old_logprobs(self.cfg)
        parts = build_rollout_parts(
            self.cfg, self.session, self.tokenizer, data, funcs, toolbox, generation,
            old_logprobs=self.computes_old_logprobs,
        )  # fmt: skip
        self.generator, self.scorer, self.evaluator = parts.generator, parts.scorer, parts.evaluator
        self.generation_mesh = parts.generation_mesh
        self.prompt_sampler = PromptSampler(
            len(data.train_prompts),
            prompts_per_generation=self.config.prompts_per_generation,
            num_generations=self.config.num_generations,
            shuffle=self.config.shuffle_dataset,
            seed=self.cfg.seed,
        )
        self.rollouts = RolloutQueue(self.config, seed=self.cfg.seed)  # generation to update
        self.rule = MicroStepRule.of(self.config, self.cfg.schedule.docs_per_step)
        staleness = self.cfg.rollout.max_staleness
        self.pipeline = RolloutPipeline(  # every generation, made now or ahead
            Producer(self.cfg, data, self.generator, self.prompt_sampler),
            # asynchronous: a copy where generation runs, which later steps leave alone
            (lambda: snapshot(self.session, self.generation_mesh))
            if staleness
            else lambda: self.session.policy_params,
            max_staleness=staleness,
            load_steps=self.rule.load_steps(),
            max_steps=self.cfg.max_steps,
            progress=lambda: self.prompt_sampler.epochs,  # carried by each generation
        )
        self.generation_s = 0.0  # time making the generations loaded since the last row
        self.sampling_stats: dict[str, int] = {}  # dynamic sampling of the last generation
        self.start_eval: dict[str, float] = {}  # held-out metrics before the first step
        self.zero_spread = ZeroSpreadWatch(self.config)
        self.window: Any = None  # the documents of the step being trained (RowDocuments)
        self.held: RolloutBatch | None = None  # a generation drawn before its micro-step
        self.stage.attach(self.cfg, self.session, self.generator)

    # -- generation ---------------------------------------------------------------------------
    def generate(self) -> RolloutBatch:
        """Take the next generation (made now, or ahead) and load it into the buffer."""
        batch = self._take()
        self._load(batch)
        return batch

    def _take(self) -> RolloutBatch:
        made = self.pipeline.take(self.session.step)
        self.generation_s += made.seconds
        if made.stats:
            self.sampling_stats = made.stats
        return made.batch

    def _load(self, batch: RolloutBatch) -> None:
        self.stage.on_generation(batch)  # the stage's fields first (PPO: values, GAE)
        self.rollouts.load(batch)

    def draw(self) -> RolloutBatch:
        """Take the next generation now; the next micro-step that loads one loads it."""
        self.held = self._take()
        return self.held

    def hold(self, drawn: RolloutBatch) -> None:
        self.held = drawn

    def _micro_step(self) -> None:
        if self.rollouts.needs_generation:  # one drawn (or held) ahead of its micro-step first
            self._load(self.held if self.held is not None else self._take())
            self.held = None
        self.rollouts.serve()  # every rank's chunk k % S

    # -- training -----------------------------------------------------------------------------
    def step(self) -> dict[str, Any]:
        """One optimizer step on the next window (``MicroStepRule``: g micro-steps, or D docs)."""
        return self.train_step()

    def next_batch(self) -> StepBatch:
        self.pipeline.launch_due(self.session.step)  # generations made ahead, if any
        self.rule.run_step(self._micro_step, lambda: len(self.rollouts))
        return self._plan_window()

    def train_on_rollouts(
        self,
        prompt_tokens: Sequence[Sequence[int]],
        completion_tokens: Sequence[Sequence[int]],
        sampler_logprobs: Sequence[Sequence[float]],
        rewards: Any,
        *,
        truncated: Sequence[bool] | None = None,
    ) -> dict[str, Any]:
        """One optimizer step on externally generated rollouts (e.g. from vLLM or SGLang).

        Rows are in group order (rows kG … kG+G−1 answer the same prompt, G =
        ``num_generations``). ``rewards``: ``[B]`` or ``[B, F]`` (None/NaN = unscored), weighted
        by ``reward_weights``. ``truncated`` defaults to "does not end in EOS". The rows take
        the trainer's own path: advantages, reference log-probs, schedule, engine. They count as
        on-policy (ρ ≡ 1) unless docs_per_step leaves some for a later step. Returns the
        metrics row, also written to metrics.jsonl.
        """
        self.start()
        batch = external_batch(
            self.generator,
            generation_params(self.session, self.generation_mesh),
            self.tokenizer,
            self.session.model_config.vocab_size,
            prompt_tokens, completion_tokens, sampler_logprobs, rewards, truncated,
        )  # fmt: skip
        batch.policy_version = self.session.step  # counted as on-policy (docstring)
        self.stage.on_generation(batch)
        self.rollouts.submit(batch)
        target = self.cfg.schedule.docs_per_step
        if len(self.rollouts) < target:
            raise ValueError(
                f"schedule.docs_per_step={target} but only {len(self.rollouts)} rollouts are "
                "available: submit at least that many (they are kept for the next call)"
            )
        step_batch = self._plan_window()
        row = self.train_on(step_batch)
        row.update(self.after_step(step_batch, row))
        self.session.writer.write(row)
        return row

    def _plan_window(self) -> StepBatch:
        """The pending rows' batch: scheduled and packed (the docs_per_step cut keeps the rest
        for a later step), with the entropy pre-pass's threshold when it is on."""
        c = self.config
        self.window = docs = self.rollouts.window()
        entropy_prepass = c.top_entropy_quantile < 1.0  # reads every rank's rows
        batch = plan_window(self.session, self.rollouts, docs, all_ranks=entropy_prepass)
        if entropy_prepass:  # no-grad pre-pass over the whole step, all ranks
            tau = self.scorer.step_entropy_threshold(
                self.session.policy_params, batch.arrays, c.top_entropy_quantile
            )
            shape = batch.packed.num_docs.shape
            batch.arrays["entropy_threshold"] = np.full(shape, tau, np.float32)
        return batch

    def train_on(self, batch: StepBatch) -> dict[str, Any]:
        """The policy's step, then the stage's on the same packed batch."""
        used_ids = np.asarray(batch.used, np.int64)
        cause = empty_cause(self.config, self.window.truncated[used_ids])
        start = time.perf_counter()
        row = self.session.train_on(batch, empty_cause=cause)
        row.update(self.stage.train_on(batch))
        row["time/train_s"] = time.perf_counter() - start
        return row

    def after_step(self, batch: StepBatch, row: dict[str, Any]) -> dict[str, Any]:
        """The rollout side's metrics of the step; its rows leave the queue (or wait, cut)."""
        docs, used = self.window, batch.used
        used_ids = np.asarray(used, np.int64)
        out = shared_prompt_metrics(batch.packed)  # the tokens shared prompts saved, if on
        out["time/generation_s"], self.generation_s = self.generation_s, 0.0
        out.update(self.pipeline.metrics())
        out.update(self.generator.metrics(self.rollouts.batches_of(docs, used)))
        out.update(self.sampling_stats)
        out.update(staleness_metrics(docs, used_ids, self.session.step))
        counters = self.session.counters
        counters.count_zero_advantages(docs.advantages[used_ids])
        out["zero_advantage_steps"] = counters.zero_advantage_steps
        self.session.say(self.zero_spread.warnings(counters, self.session.step, {**row, **out}))
        self.rollouts.done(docs, batch.returned)
        return out

    def parameters(self) -> list[Any]:
        return [self.session.state.params, *self.stage.parameters()]

    # -- evaluation, state, the start and the end ---------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """Held-out ``eval/accuracy`` (greedy) and ``eval/accuracy_sampled`` (k samples per prompt
        at the training temperature, ``logging.eval_samples``), scored by the exact answer; with
        ``logging.eval_rewards`` also ``eval/reward[_sampled]`` from the run's reward functions."""
        if self.evaluator is None:
            return {}
        return self.evaluator(self.generator.sampler_params(self.session.policy_params)).metrics()

    def host_state(self) -> dict[str, Any]:
        """Everything outside the TrainState that a resumed run needs, as JSON (generations
        made ahead first: they advance the prompt order)."""
        ahead = self.pipeline.state_dict() if self.cfg.rollout.max_staleness else None
        if ahead is None and self.pipeline.pending:  # an asynchronous run's, resumed
            ahead = self.pipeline.state_dict()
        return {
            **({"pipeline": ahead} if ahead is not None else {}),
            "prompt_sampler": self.prompt_sampler.state_dict(),
            "rollouts": self.rollouts.state_dict(),
            "start_eval": self.start_eval,
            "sampling_stats": self.sampling_stats,
        }

    def load_host_state(self, host: dict[str, Any]) -> None:
        self.prompt_sampler.load_state_dict(host["prompt_sampler"])
        self.rollouts.load_state_dict(host["rollouts"])
        legacy = {"eval/accuracy": host.get("start_accuracy")}  # checkpoints before eval_sampled
        self.start_eval = host.get("start_eval", legacy)
        self.sampling_stats = host.get("sampling_stats", {})
        # an asynchronous run's generations made ahead are trained first; else start here
        done = self.rollouts.next_id
        self.pipeline.load_state_dict(
            host.get("pipeline") or {"launched": done, "taken": done, "ready": []}
        )

    def save_checkpoint(self, step: int) -> None:
        self.stage.save(step)

    def restore_checkpoint(self, step: int) -> None:
        self.stage.restore(step)

    def precompile(self) -> None:
        precompile_start(self.session, self.generator, self.data, self.prompt_sampler)

    def begin(self) -> None:
        self.start_eval = self.evaluate()

    def epoch(self) -> float:
        return self.pipeline.progress_taken(self.prompt_sampler.epochs)

    def info(self, row: dict[str, Any]) -> str:
        return f"reward {row['reward']:.3f}"

    def stop(self, row: dict[str, Any]) -> bool:
        """``grpo.stop_on_zero_spread``: end the run once it has stopped learning."""
        lines = self.zero_spread.stop_lines(self.session.counters, self.session.step)
        self.session.say(lines)
        return bool(lines)

    def summary(self, summary: dict[str, Any], last: dict[str, Any]) -> dict[str, Any]:
        """The summary, the starting metrics and the plot of reward and accuracy."""
        plot = self.session.output_dir / PLOT_NAME
        if self.session.primary:
            metrics = read_metrics(self.session.writer.path)
            plot_reward_and_accuracy(metrics, plot, start=self.start_eval)
        start = {f"{k}_start": v for k, v in self.start_eval.items()}
        stopped = {"stopped_zero_spread": self.zero_spread.stops(self.session.counters)}
        return self.stage.summary(
            {**summary, **start, **self.data_report, "plot": str(plot), **stopped}
        )

    def close(self) -> None:
        self.pipeline.close()
        self.generator.close()  # vLLM servers jaxrl started
        self.stage.close()


class GRPOTrainer(RolloutTrainer):
    """GRPO on a built-in task or on ``data.train`` (TRL's prompt-only format: ``prompt`` as text
    or messages, every other column passed to the reward functions); ``run()`` trains
    ``max_steps`` and returns a summary.

    ``reward_funcs``: callables called as TRL calls them (``jaxrl.rollout.rewards``) or the
    config entries of ``grpo.reward_funcs`` (``jaxrl.rollout.rewards.specs``); when not given,
    ``grpo.reward_funcs``, and without that the built-in task's ``exact_answer`` and
    ``format`` (``load_reward_funcs``). Weighted by ``grpo.reward_weights``. The task's
    ``answer`` is passed as a column.
    """

    def __init__(self, cfg: RunConfig, *, reward_funcs: Sequence[str | RewardFunc] | None = None):
        super().__init__(cfg, reward_funcs=reward_funcs, stage=Stage())
