"""GRPO trainer (GRPO / GSPO / DAPO / Dr.GRPO): sampler → rewards → row queue → exact engine.

Per generation (as in TRL): the next prompts in TRL ``RepeatSampler`` order → ``RolloutGenerator``
(weights synced from the trainer, KV-cache sampling, rewards, advantages on the whole batch, each
row's document, old / reference log-probs when needed) → the ``RolloutQueue``, which holds every
row until it is trained on (the generation buffer inside it serves them). Per optimizer step: the
window's documents (the micro-steps ``MicroStepRule`` says make a step) → ``build_dp_schedule``
as one step → packed ``[R, M, T]`` batch → the train step with ``grpo_objective``. Generations
come from the ``RolloutPipeline`` (made when taken, or ahead with ``rollout.max_staleness``)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxrl.config import RunConfig
from jaxrl.rollout.buffer import MicroStepRule, PromptSampler
from jaxrl.rollout.pipeline import RolloutPipeline
from jaxrl.rollout.rewards.compute import RewardFunc
from jaxrl.rollout.rollout_queue import RolloutBatch, RolloutQueue
from jaxrl.rollout.tools.toolbox import toolbox_from_config
from jaxrl.runtime.mesh import reserve_devices, run_devices
from jaxrl.train.objectives import grpo_objective
from jaxrl.train.run_io.metrics import read_metrics
from jaxrl.train.run_io.plots import plot_reward_and_accuracy
from jaxrl.trainers.counters import empty_cause, zero_advantage_warning
from jaxrl.trainers.external_rollouts import external_batch
from jaxrl.trainers.grpo_rollouts import (
    DEFAULT_REWARD_FUNCS,
    GRPOData,
    Producer,
    build_rollout_parts,
    check_rollout_settings,
    check_shared_prompt,
    generation_params,
    load_reward_funcs,
    needs_old_logprobs,
    plan_window,
    precompile_start,
    shared_prompt_metrics,
    snapshot,
)
from jaxrl.trainers.preamble import Preamble
from jaxrl.trainers.session import generation_devices, with_device_ranks

__all__ = ["DEFAULT_REWARD_FUNCS", "PLOT_NAME", "GRPOTrainer", "load_reward_funcs"]

PLOT_NAME = "grpo_progress.png"


class GRPOTrainer:
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
        cfg = with_device_ranks(cfg)
        check_rollout_settings(cfg)
        # rollout.max_staleness >= 1: the last devices generate, the others train
        with reserve_devices(generation_devices(cfg, len(run_devices()))) as generation:
            self._build(cfg, reward_funcs, generation)

    def _build(
        self, cfg: RunConfig, reward_funcs: Sequence[str | RewardFunc] | None, generation: list
    ) -> None:
        funcs = load_reward_funcs(cfg.grpo, reward_funcs)
        pre = Preamble(cfg)
        self.cfg, self.config, self.tokenizer = pre.cfg, pre.cfg.grpo, pre.tokenizer
        # tools / environment (docs/tools.md): loaded now, their schemas go into the prompts
        toolbox = toolbox_from_config(self.config) if self.config.uses_tools else None
        if toolbox is not None:  # an environment's get_reward() is a reward (TRL)
            funcs = [*funcs, *toolbox.reward_funcs()]
        self.data = data = GRPOData.load(pre, self.config, toolbox)
        self.data_report = pre.data_report  # prompts the length limit cut
        builtin = self.cfg.data.train is None  # the task's problems (notebooks, benchmarks)
        self.train_examples = data.examples("train") if builtin else None
        self.eval_examples = data.examples("eval") if builtin else None
        self.session = pre.session(self._objective())
        check_shared_prompt(self.config, self.session.model_config)
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
            self._snapshot if staleness else lambda: self.session.policy_params,
            max_staleness=staleness,
            load_steps=self.rule.load_steps(),
            max_steps=self.cfg.max_steps,
            progress=lambda: self.prompt_sampler.epochs,  # carried by each generation
        )
        self.generation_s = 0.0  # time making the generations loaded since the last row
        self.sampling_stats: dict[str, int] = {}  # dynamic sampling of the last generation
        self.start_eval: dict[str, float] = {}  # held-out metrics before the first step
        self.warned_zero_advantage = False
        self._started = False

    def _objective(self) -> Any:  # what the step minimises (PPO: its actor's)
        return grpo_objective(self.config, chunk_size=self.cfg.model.logprob_chunk)

    # -- generation ---------------------------------------------------------------------------
    @property
    def computes_old_logprobs(self) -> bool:
        return needs_old_logprobs(self.cfg)

    def _snapshot(self) -> Any:
        return snapshot(self.session, self.generation_mesh)

    def generate(self) -> RolloutBatch:
        """Take the next generation (made now, or ahead) and load it into the buffer."""
        made = self.pipeline.take(self.session.step)
        self.generation_s += made.seconds
        if made.stats:
            self.sampling_stats = made.stats
        self.rollouts.load(made.batch)
        return made.batch

    def _micro_step(self) -> None:
        if self.rollouts.needs_generation:
            self.generate()
        self.rollouts.serve()  # every rank's chunk k % S

    # -- training -----------------------------------------------------------------------------
    def step(self) -> dict[str, Any]:
        """One optimizer step on the next window (``MicroStepRule``: g micro-steps, or D docs)."""
        self._start()
        self.pipeline.launch_due(self.session.step)  # generations made ahead, if any
        self.rule.run_step(self._micro_step, lambda: len(self.rollouts))
        return self._train_pending()

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
        self._start()
        batch = external_batch(
            self.generator,
            generation_params(self.session, self.generation_mesh),
            self.tokenizer,
            self.session.model_config.vocab_size,
            prompt_tokens, completion_tokens, sampler_logprobs, rewards, truncated,
        )  # fmt: skip
        batch.policy_version = self.session.step  # counted as on-policy (docstring)
        self.rollouts.submit(batch)
        target = self.cfg.schedule.docs_per_step
        if len(self.rollouts) < target:
            raise ValueError(
                f"schedule.docs_per_step={target} but only {len(self.rollouts)} rollouts are "
                "available: submit at least that many (they are kept for the next call)"
            )
        row = self._train_pending()
        self.session.writer.write(row)
        return row

    def _train_pending(self) -> dict[str, Any]:
        """Schedule, pack and train on the pending rows (the docs_per_step cut keeps the rest)."""
        c = self.config
        docs = self.rollouts.window()
        entropy_prepass = c.top_entropy_quantile < 1.0  # reads every rank's rows
        batch = plan_window(self.session, self.rollouts, docs, all_ranks=entropy_prepass)
        used, arrays, packed = batch.used, batch.arrays, batch.packed
        if entropy_prepass:  # no-grad pre-pass over the whole step, all ranks
            tau = self.scorer.step_entropy_threshold(
                self.session.policy_params, arrays, c.top_entropy_quantile
            )
            arrays["entropy_threshold"] = np.full(packed.num_docs.shape, tau, np.float32)
        used_ids = np.asarray(used, np.int64)
        start = time.perf_counter()
        cause = empty_cause(self.config, docs.truncated[used_ids])
        row = self._train_on(batch, cause)
        row["time/train_s"] = time.perf_counter() - start
        row.update(shared_prompt_metrics(packed))  # the tokens shared prompts saved, if on
        row["time/generation_s"], self.generation_s = self.generation_s, 0.0
        row.update(self.pipeline.metrics())
        row.update(self.generator.metrics(self.rollouts.batches_of(docs, used)))
        row.update(self.sampling_stats)
        if used_ids.size:  # updates since the weights that generated each trained row
            staleness = self.session.step - 1 - docs.versions[used_ids]
            row["rollout/staleness_mean"] = float(staleness.mean())
            row["rollout/staleness_max"] = int(staleness.max())
        zero = self.session.counters.count_zero_advantages(docs.advantages[used_ids])
        row["zero_advantage_steps"] = self.session.counters.zero_advantage_steps
        if zero and not self.warned_zero_advantage:
            self.warned_zero_advantage = True
            self.session.say([zero_advantage_warning(self.session.step, self.config, row)])
        self.rollouts.done(docs, batch.returned)
        return row

    def _train_on(self, batch: Any, cause: str) -> dict[str, Any]:  # PPO: + the critic's step
        return self.session.train_on(batch, empty_cause=cause)

    # -- evaluation, state, the loop ----------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """Held-out ``eval/accuracy`` (greedy) and ``eval/accuracy_sampled`` (k samples per prompt
        at the training temperature, ``logging.eval_samples``), scored by the exact answer."""
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

    def _start(self) -> None:
        """Resume from the newest checkpoint (or measure the starting accuracy); once."""
        if self._started:
            return
        self._started = True
        host = self.session.resume({})
        if host is None:
            precompile_start(self.session, self.generator, self.data, self.prompt_sampler)
            self.start_eval = self.evaluate()
            return
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
        precompile_start(self.session, self.generator, self.data, self.prompt_sampler)

    def run(self) -> dict[str, Any]:
        """Train to ``max_steps`` (resuming if a checkpoint exists); returns a summary."""
        session = self.session
        start = time.perf_counter()
        try:
            self._start()
            last = session.loop(
                "grpo",
                self.step,
                first_row=self.data_report,  # rows the length limits touched
                epoch=lambda: self.pipeline.progress_taken(self.prompt_sampler.epochs),
                host_state=self.host_state,
                evaluate=self.evaluate,
                info=lambda row: f"reward {row['reward']:.3f}",
            )
            plot = session.output_dir / PLOT_NAME
            if session.primary:
                metrics = read_metrics(session.writer.path)
                plot_reward_and_accuracy(metrics, plot, start=self.start_eval)
            summary = session.finish(last, self.tokenizer, self.evaluate, started=start)
        finally:
            self.pipeline.close()
            self.generator.close()  # vLLM servers jaxrl started
        return {
            **summary,
            **{f"{k}_start": v for k, v in self.start_eval.items()},
            **self.data_report,
            "plot": str(plot),
        }
