"""GRPO trainer (GRPO / GSPO / DAPO / Dr.GRPO): sampler → rewards → row queue → exact engine.

Per generation (as in TRL): the next prompts in TRL ``RepeatSampler`` order →
``RolloutGenerator`` (weights synced from the trainer, KV-cache sampling, rewards, advantages on
the whole batch, each row's document, old / reference log-probs when needed) → the
``RolloutQueue``, which holds every row until it is trained on (the generation buffer inside it
serves them). Per optimizer step: the window's documents (g micro-steps of every rank, or
``docs_per_step`` documents) → ``build_dp_schedule`` as one step → packed ``[R, M, T]`` batch →
the train step with ``grpo_objective``. Orchestration only: the numerics live in losses/, train/ and
rollout/.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl.config import ConfigError, GRPOConfig, RunConfig
from jaxrl.data.datasets import Dataset
from jaxrl.data.documents import grpo_prompts
from jaxrl.data.tasks import Example
from jaxrl.data.tokenizer import load_tokenizer
from jaxrl.losses.advantages import informative_groups
from jaxrl.rollout.buffer import PromptSampler
from jaxrl.rollout.builtin_rewards import ExactAnswer, exact_answer_reward
from jaxrl.rollout.episodes import EpisodeRunner
from jaxrl.rollout.generator import RolloutGenerator, Sampled
from jaxrl.rollout.heldout import HeldoutEvaluator
from jaxrl.rollout.pipeline import Generated, RolloutPipeline, load_steps
from jaxrl.rollout.reward_specs import resolve_reward_funcs
from jaxrl.rollout.rewards import RewardFunc, TrainingProgress, check_reward
from jaxrl.rollout.rollout_queue import RolloutBatch, RolloutQueue
from jaxrl.rollout.tool_eval import EpisodeEvaluator
from jaxrl.rollout.tools import toolbox_from_config
from jaxrl.runtime.mesh import make_mesh, reserve_devices, run_devices
from jaxrl.train.build import build_task
from jaxrl.train.metrics import read_metrics
from jaxrl.train.objectives import grpo_objective
from jaxrl.train.plots import plot_reward_and_accuracy
from jaxrl.train.score import Scorer
from jaxrl.trainers.run_data import run_datasets
from jaxrl.trainers.session import Session, generation_devices, with_device_ranks

DEFAULT_REWARD_FUNCS = ("exact_answer", "format")
PLOT_NAME = "grpo_progress.png"


class GRPOTrainer:
    """GRPO on a built-in task or on ``data.train`` (TRL's prompt-only format: ``prompt`` as text
    or messages, every other column passed to the reward functions); ``run()`` trains
    ``max_steps`` and returns a summary.

    ``reward_funcs``: callables called as TRL calls them (``jaxrl.rollout.rewards``) or the
    config entries of ``grpo.reward_funcs`` (``jaxrl.rollout.reward_specs``); when not given,
    ``grpo.reward_funcs``, and without that the built-in task's ``exact_answer`` and
    ``format`` (``load_reward_funcs``). Weighted by ``grpo.reward_weights``. The task's
    ``answer`` is passed as a column.
    """

    def __init__(self, cfg: RunConfig, *, reward_funcs: Sequence[str | RewardFunc] | None = None):
        cfg = with_device_ranks(cfg)
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
        # rollout.max_staleness >= 1: the last devices generate, the others train
        with reserve_devices(generation_devices(cfg, len(run_devices()))) as generation:
            self._build(cfg, reward_funcs, generation)

    def _build(
        self, cfg: RunConfig, reward_funcs: Sequence[str | RewardFunc] | None, generation: list
    ) -> None:
        config = cfg.grpo
        funcs = load_reward_funcs(config, reward_funcs)
        cfg = _resolve_run_config(cfg, config)
        self.cfg, self.config = cfg, config
        self.data_report: dict[str, int] = {}  # prompts the length limit cut
        self.warnings: list[str] = []  # printed once the session (process 0's console) exists
        builtin = cfg.data.train is None
        if builtin:  # the built-in task: rows of prompt and answer
            self.tokenizer = tok = build_task(cfg).tokenizer()
        else:
            self.tokenizer = tok = load_tokenizer(cfg.model.path)
        # tools / environment (docs/tools.md): loaded now, their schemas go into the prompts
        self.toolbox = toolbox_from_config(config) if config.uses_tools else None
        if self.toolbox is not None:  # an environment's get_reward() is a reward (TRL)
            funcs = [*funcs, *self.toolbox.reward_funcs()]
        data = run_datasets(cfg, "grpo")
        self.train_rows, self.train_prompts = self._prompts("train", data["train"])
        self.eval_rows, self.eval_prompts = [], []
        if "eval" in data:
            self.eval_rows, self.eval_prompts = self._prompts("eval", data["eval"])
            if any("answer" not in r for r in self.eval_rows):
                raise ConfigError(
                    f"data.eval={cfg.data.eval!r} is invalid for GRPO: held-out accuracy scores "
                    "completions against an 'answer' column, which its rows lack; add one "
                    "(or leave data.eval out)"
                )
        # the built-in task's problems (notebooks and benchmarks read them); None on real data
        as_example = lambda r: Example(r["prompt"], r["answer"])
        self.train_examples = [as_example(r) for r in self.train_rows] if builtin else None
        self.eval_examples = [as_example(r) for r in self.eval_rows] if builtin else None
        self.columns = list(dict.fromkeys(k for r in self.train_rows for k in r if k != "prompt"))
        longest = max(len(p) for p in self.train_prompts + self.eval_prompts)
        if longest + config.max_completion_length > cfg.schedule.max_tokens:
            raise ConfigError(
                f"schedule.max_tokens={cfg.schedule.max_tokens} is invalid: a prompt of {longest} "
                f"tokens plus grpo.max_completion_length={config.max_completion_length} must "
                "fit one row; raise schedule.max_tokens or lower max_completion_length"
            )
        chunk = cfg.model.logprob_chunk
        self.session = Session(cfg, tok.vocab_size, grpo_objective(config, chunk_size=chunk))
        self.session.say(self.warnings)
        # where generation runs: its own devices (rollout.devices), else the trainer's
        self.generation_mesh = make_mesh(devices=generation) if generation else self.session.mesh
        ref_params = None
        if config.beta != 0.0:
            # the frozen initial parameters, a real copy (the train step donates its buffers), in
            # the compute dtype (docs/precision.md), where generation runs
            # (with LoRA: the same model with its adapters disabled, no second copy)
            ref_params = self.session.reference_params()
            if generation:
                ref_params = jax.device_put(ref_params, self._generation_sharding)
        episodes = None  # multi-turn episodes with tools (jaxrl.rollout.episodes)
        if self.toolbox is not None:
            episodes = EpisodeRunner(
                tok,
                self.toolbox,
                max_turns=config.max_turns,
                max_completion_length=config.max_completion_length,
            )
        self.generator = RolloutGenerator(
            config,
            self.session.model_config,
            self.session.graphdef,
            tok,
            reward_funcs=funcs,
            row_len=cfg.schedule.max_tokens,
            chunk_size=chunk,
            old_logprobs=self.computes_old_logprobs,
            ref_params=ref_params,
            mesh=self.generation_mesh,
            episodes=episodes,
            max_slots=cfg.rollout.max_slots,
            # synchronous: the sampler reads the trainer's weights in place (no copy) when
            # they are in the compute dtype; generation overlapping training needs its copy
            copy_params=cfg.rollout.max_staleness > 0,
        )
        # the entropy pre-pass scores the trainer's own parameters, on the trainer's devices
        self.scorer = self.generator.scorer
        if generation:
            self.scorer = Scorer(
                self.session.graphdef,
                mesh=self.session.mesh,
                row_len=cfg.schedule.max_tokens,
                temperature=config.temperature,
                chunk_size=chunk,
            )
        self.evaluator = None  # no held-out rows: no eval metrics
        if self.eval_rows:
            evaluator = (
                HeldoutEvaluator
                if episodes is None
                else functools.partial(EpisodeEvaluator, runner=episodes)
            )
            self.evaluator = evaluator(
                self.generator.sampler.config,  # what a sampler runs (LoRA: the merged model)
                tok,
                [r["prompt"] for r in self.eval_rows],
                [r["answer"] for r in self.eval_rows],
                prompt_ids=self.eval_prompts,
                max_new_tokens=config.max_completion_length,
                sampling=self.generator.sampler.sampling,
                samples_per_prompt=cfg.logging.eval_samples,
                seed=cfg.seed,
                mesh=self.session.mesh,
                # synchronous: one sampler, one weight copy; asynchronous: a sampler of its own
                # on the trainer's devices, so evaluations run beside the generation in flight
                sampler=None if cfg.rollout.max_staleness else self.generator.sampler,
                # held-out accuracy parses answers as the run's exact_answer reward does (its
                # fallback included); the strict default otherwise
                reward=next(
                    (f for f in self.generator.reward_funcs if isinstance(f, ExactAnswer)),
                    exact_answer_reward,
                ),
            )
        if config.prompts_per_generation > len(self.train_prompts):
            raise ConfigError(
                f"grpo.generation_batch_size={config.generation_batch_size} is invalid: a "
                f"generation takes {config.prompts_per_generation} prompts (× "
                f"{config.num_generations} completions) but the training data holds "
                f"{len(self.train_prompts)}; lower the batch size or add data"
            )
        self.prompt_sampler = PromptSampler(
            len(self.train_prompts),
            prompts_per_generation=config.prompts_per_generation,
            num_generations=config.num_generations,
            shuffle=config.shuffle_dataset,
            seed=cfg.seed,
        )
        self.rollouts = RolloutQueue(config, seed=cfg.seed)  # every row, generation to update
        self.pipeline = None  # rollout.max_staleness >= 1: generations made ahead
        if cfg.rollout.max_staleness:
            self.pipeline = RolloutPipeline(
                self._produce,
                self._snapshot,
                max_staleness=cfg.rollout.max_staleness,
                load_steps=load_steps(config, cfg.schedule.docs_per_step),
                max_steps=cfg.max_steps,
            )
        self.generation_s = 0.0  # time making the generations loaded since the last row
        self._ahead: deque[Generated] = deque()  # made ahead by an asynchronous run, resumed
        self.sampling_stats: dict[str, int] = {}  # dynamic sampling of the last generation
        self.start_eval: dict[str, float] = {}  # held-out metrics before the first step
        self.warned_zero_advantage = False
        self._started = False

    def _prompts(self, split: str, data: Dataset) -> tuple[list[dict], list[np.ndarray]]:
        """Rows and prompt ids of a GRPO dataset (chat template for conversational prompts);
        prompts over ``grpo.max_prompt_length`` keep their last tokens, counted and reported."""
        limit = self.config.max_prompt_length or 2**31 - 1
        tools = self.toolbox.schemas if self.toolbox is not None else None
        prompts = grpo_prompts(data, self.tokenizer, max_prompt_length=limit, tools=tools)
        self.data_report.update(prompts.report.metrics(split))
        if (line := prompts.report.warning(split, f"grpo.max_prompt_length={limit}")) is not None:
            self.warnings.append(line)
        return data.rows, prompts.ids

    # -- generation ---------------------------------------------------------------------------
    @property
    def computes_old_logprobs(self) -> bool:
        """Old log-probs when a buffered row may be trained on after an update
        (docs/algorithms/grpo.md §5), or always under docs_per_step (leftover documents wait for
        the next step)."""
        return (
            self.config.needs_old_logprobs
            or self.cfg.schedule.docs_per_step > 0
            or self.cfg.rollout.max_staleness > 0  # generated by older weights
            or self.config.kl_in_reward  # REINFORCE++'s KL: generating policy vs reference
        )

    @property
    def _generation_sharding(self) -> NamedSharding:
        return NamedSharding(self.generation_mesh, P())

    def generate(self) -> RolloutBatch:
        """Make (or, asynchronously, take the finished) next generation batch and load it into
        the buffer (:meth:`_produce`)."""
        if self._ahead:  # resumed from an asynchronous run with rollout.max_staleness=0
            made = self._ahead.popleft()
            batch, stats = made.batch, made.stats
        elif self.pipeline is None:
            start = time.perf_counter()
            batch, stats = self._produce(self.session.policy_params, self.session.step)
            self.generation_s += time.perf_counter() - start
        else:
            made = self.pipeline.take(self.session.step)
            batch, stats = made.batch, made.stats
            self.generation_s += made.seconds
        if stats:
            self.sampling_stats = stats
        self.rollouts.load(batch)
        return batch

    def _produce(self, params: Any, step: int) -> tuple[RolloutBatch, dict[str, int]]:
        """The next generation batch, made with ``params`` (the weights after ``step`` updates),
        and its dynamic-sampling stats.

        With ``grpo.dynamic_sampling`` (DAPO) the prompt groups whose rewards all agree (no
        learning signal: ``informative_groups``) are dropped and the next prompts are sampled
        until the batch holds ``generation_batch_size / num_generations`` groups (the first
        ones, in order; the rest are discarded, as DAPO does), at most
        ``max_dynamic_sampling_rounds`` generations; advantages are computed on the final batch.
        """
        stats: dict[str, int] = {}
        if self.config.dynamic_sampling:
            sampled, stats = self._fill_with_signal(params, step)
        else:
            sampled = self._sample_next(params, step)
        batch = self.generator.build(params, *sampled)
        batch.policy_version = step
        return batch, stats

    def _generation_params(self) -> Any:
        """The current parameters where the generator's scorer runs: themselves, or a copy on
        the generation devices."""
        if self.generation_mesh is self.session.mesh:
            return self.session.policy_params
        return self._snapshot()

    def _snapshot(self) -> Any:
        """A copy of the current parameters where generation runs, which later train steps
        (they donate their buffers) leave alone: the asynchronous generations' weights."""
        params = self.session.policy_params
        if self.generation_mesh is not self.session.mesh:
            return jax.device_put(params, self._generation_sharding, may_alias=False)
        return jax.tree.map(lambda x: jax.device_put(x, x.sharding, may_alias=False), params)

    def _sample_next(self, params: Any, step: int) -> Sampled:
        """The next generation's prompts, sampled and scored."""
        n = self.prompt_sampler.generations
        idx = self.prompt_sampler.next_generation()
        rows = [self.train_rows[i] for i in idx]
        return self.generator.sample(
            params,
            [self.train_prompts[i] for i in idx],
            [r["prompt"] for r in rows],
            {k: [r.get(k) for r in rows] for k in self.columns},
            jax.random.fold_in(jax.random.key(self.cfg.seed), n),
            TrainingProgress(global_step=step, max_steps=self.cfg.max_steps),
        )

    def _fill_with_signal(self, params: Any, step: int) -> tuple[Sampled, dict[str, int]]:
        """DAPO's dynamic sampling: keep drawing generations until enough groups have rewards
        that differ; returns the rows and the rounds and dropped groups (metrics)."""
        c, g = self.config, self.config.num_generations
        need = c.generation_batch_size // g
        weights = c.reward_weights  # generated rows: one column per reward function
        parts, kept, dropped = [], 0, 0
        for _ in range(c.max_dynamic_sampling_rounds):
            sampled = self._sample_next(params, step)
            keep_Q = informative_groups(sampled.rewards_BW, g, weights)
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

    def _micro_step(self) -> None:
        if self.rollouts.needs_generation:
            self.generate()
        self.rollouts.serve()  # every rank's chunk k % S

    # -- training -----------------------------------------------------------------------------
    def step(self) -> dict[str, Any]:
        """One optimizer step on the next window (g micro-steps, or docs_per_step documents)."""
        self._start()
        if self.pipeline is not None:  # generations this step's weights make ahead
            self.pipeline.launch_due(self.session.step)
        target = self.cfg.schedule.docs_per_step
        if target == 0:
            for _ in range(self.config.gradient_accumulation_steps):
                self._micro_step()
        while len(self.rollouts) < target:
            self._micro_step()
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
        check_rollouts(
            prompt_tokens,
            completion_tokens,
            sampler_logprobs,
            rewards,
            truncated,
            vocab_size=self.session.model_config.vocab_size,
        )
        r_BW = np.asarray(
            [[np.nan if v is None else v for v in np.atleast_1d(row)] for row in rewards],
            np.float64,
        )
        for (row, col), value in np.ndenumerate(r_BW):
            check_reward(value, f"train_on_rollouts: rewards[{row}][{col}] = {value:g}")
        if truncated is None:
            eos = self.tokenizer.eos_id
            truncated = [len(c) == 0 or int(c[-1]) != eos for c in completion_tokens]
        batch = self.generator.build(
            self._generation_params(),
            [np.asarray(p) for p in prompt_tokens],
            [np.asarray(c) for c in completion_tokens],
            [np.asarray(x) for x in sampler_logprobs],
            np.asarray(truncated, bool),
            r_BW,
        )
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
        batch = self.session.plan(
            range(len(docs)),
            lengths=[len(x) for x in docs.sequences],
            sequences=docs.sequences,
            loss_masks=docs.loss_masks,
            token_fields=docs.token_fields,
            doc_fields={"advantage": docs.advantages},
            all_ranks=entropy_prepass,
        )
        used, arrays, packed = batch.used, batch.arrays, batch.packed
        if entropy_prepass:  # no-grad pre-pass over the whole step, all ranks
            tau = self.scorer.step_entropy_threshold(
                self.session.policy_params, arrays, c.top_entropy_quantile
            )
            arrays["entropy_threshold"] = np.full(packed.num_docs.shape, tau, np.float32)
        used_ids = np.asarray(used, np.int64)
        start = time.perf_counter()
        row = self.session.train_on(batch, empty_cause=self._empty_cause(docs.truncated[used_ids]))
        row["time/train_s"] = time.perf_counter() - start
        row["time/generation_s"], self.generation_s = self.generation_s, 0.0
        if self.pipeline is not None:
            row.update(self.pipeline.metrics())
        row.update(self.generator.metrics(self.rollouts.batches_of(docs, used)))
        row.update(self.sampling_stats)
        if used_ids.size:  # updates since the weights that generated each trained row
            staleness = self.session.step - 1 - docs.versions[used_ids]
            row["rollout/staleness_mean"] = float(staleness.mean())
            row["rollout/staleness_max"] = int(staleness.max())
        self._count_zero_advantages(row, docs.advantages[used_ids])
        self.rollouts.done(docs, batch.returned)
        return row

    def _empty_cause(self, truncated: np.ndarray) -> str:
        """Why a step's completions may carry no loss token, and the fix."""
        c = self.config
        if c.mask_truncated_completions and int(truncated.sum()) == len(truncated):
            return (
                f"All {len(truncated)} completions were truncated at grpo.max_completion_length="
                f"{c.max_completion_length}, and grpo.mask_truncated_completions=true leaves "
                "truncated completions out of the loss: raise grpo.max_completion_length, or set "
                "grpo.mask_truncated_completions=false"
            )
        return "Every completion of the step is empty"

    def _count_zero_advantages(self, row: dict[str, Any], advantages: np.ndarray) -> None:
        """Count (``zero_advantage_steps``) and warn once about a step whose advantages are all
        zero: every group's rewards were equal, so the policy gradient is zero."""
        zero = advantages.size > 0 and not np.any(advantages)
        counters = self.session.counters  # checkpointed by the session
        counters.zero_advantage_steps += zero
        row["zero_advantage_steps"] = counters.zero_advantage_steps
        if zero and not self.warned_zero_advantage:
            self.warned_zero_advantage = True
            rewards = f" (reward {row['reward']:g})" if "reward" in row else ""
            self.session.say(
                [
                    f"warning: step {self.session.step}: every completion's advantage is 0, "
                    f"because the rewards within each group of {self.config.num_generations} "
                    f"were all equal{rewards}, so the policy gradient is zero "
                    "(zero_advantage_steps counts such steps). The rewards give this model no "
                    "signal: check that it can earn them (e.g. that it writes the answer format "
                    "the reward functions parse; state the format in the prompt), or raise "
                    "grpo.num_generations or grpo.temperature"
                ]
            )

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
        ahead = {} if self.pipeline is None else {"pipeline": self.pipeline.state_dict()}
        return {
            **ahead,
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
            self.start_eval = self.evaluate()
            return
        self.prompt_sampler.load_state_dict(host["prompt_sampler"])
        self.rollouts.load_state_dict(host["rollouts"])
        legacy = {"eval/accuracy": host.get("start_accuracy")}  # checkpoints before eval_sampled
        self.start_eval = host.get("start_eval", legacy)
        self.sampling_stats = host.get("sampling_stats", {})
        ahead = host.get("pipeline")
        if self.pipeline is not None:  # a synchronous checkpoint: the pipeline starts here
            done = self.rollouts.next_id
            self.pipeline.load_state_dict(ahead or {"launched": done, "taken": done, "ready": []})
        elif ahead is not None:  # generations an asynchronous run made ahead are trained first
            self._ahead.extend(Generated.from_json(g) for g in ahead["ready"])

    def run(self) -> dict[str, Any]:
        """Train to ``max_steps`` (resuming if a checkpoint exists); returns a summary."""
        session = self.session
        self._start()
        start = time.perf_counter()
        try:
            last = session.loop(
                "grpo",
                self.step,
                first_row=self.data_report,  # rows the length limits touched
                epoch=lambda: self.prompt_sampler.epochs,
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
            if self.pipeline is not None:
                self.pipeline.close()
        return {
            **summary,
            **{f"{k}_start": v for k, v in self.start_eval.items()},
            **self.data_report,
            "plot": str(plot),
        }


def load_reward_funcs(
    config: GRPOConfig, given: Sequence[str | RewardFunc] | None = None
) -> list[RewardFunc]:
    """The run's reward functions, loaded and checked (``jaxrl.rollout.reward_specs``; user
    modules run here): ``given`` (``GRPOTrainer``'s argument), else ``grpo.reward_funcs``, else
    the built-in task's ``DEFAULT_REWARD_FUNCS``."""
    length = config.max_completion_length
    if given:
        return resolve_reward_funcs(given, max_completion_length=length)
    specs = config.reward_funcs or DEFAULT_REWARD_FUNCS
    return resolve_reward_funcs(specs, field="grpo.reward_funcs", max_completion_length=length)


def _resolve_run_config(cfg: RunConfig, config: GRPOConfig) -> RunConfig:
    """The GRPO stage's optimizer: ``grpo.learning_rate``, ``warmup_steps`` and
    ``lr_scheduler_type`` over ``optimizer``'s (an SFT warm start keeps ``optimizer``'s)."""
    stage = {
        "learning_rate": config.learning_rate,
        "warmup_steps": config.warmup_steps,
        "decay": config.lr_scheduler_type,
    }
    stage = {k: v for k, v in stage.items() if v is not None}
    if not stage:
        return cfg
    return dataclasses.replace(cfg, optimizer=dataclasses.replace(cfg.optimizer, **stage))


LOGPROB_TOLERANCE = 1e-3  # sampler log-probs may exceed 0 by this much (rounding in the sampler)


def _token_rows(what: str, rows: Sequence[Any], vocab_size: int) -> list[np.ndarray]:
    """``rows`` as 1-D integer arrays, or ``ValueError`` naming the row."""
    out = []
    for i, ids in enumerate(rows):
        arr = np.asarray(ids)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise ValueError(
                f"train_on_rollouts: {what}[{i}] is not a list of token ids (got "
                f"{arr.dtype} {arr.shape}): give one list of ints per rollout"
            )
        if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
            raise ValueError(
                f"train_on_rollouts: {what}[{i}] holds ids outside [0, {vocab_size}) "
                f"(min {arr.min()}, max {arr.max()}): use the trainer's tokenizer"
            )
        out.append(arr)
    return out


def check_rollouts(
    prompt_tokens: Sequence[Any],
    completion_tokens: Sequence[Any],
    sampler_logprobs: Sequence[Any],
    rewards: Any,
    truncated: Sequence[bool] | None,
    *,
    vocab_size: int,
) -> None:
    """``train_on_rollouts``' inputs, or ``ValueError`` naming the row: one entry of each per
    rollout, token ids in the vocabulary, and one finite sampler log-prob ``<= 0`` (within
    ``LOGPROB_TOLERANCE``) per completion token."""
    n = len(completion_tokens)
    counts = {"prompt_tokens": len(prompt_tokens), "sampler_logprobs": len(sampler_logprobs)}
    counts["rewards"] = len(rewards)
    if truncated is not None:
        counts["truncated"] = len(truncated)
    for what, count in counts.items():
        if count != n:
            raise ValueError(
                f"train_on_rollouts: {count} {what} rows for {n} completion_tokens rows: give one "
                "per rollout"
            )
    _token_rows("prompt_tokens", prompt_tokens, vocab_size)
    completions = _token_rows("completion_tokens", completion_tokens, vocab_size)
    for i, (ids, logps) in enumerate(zip(completions, sampler_logprobs, strict=True)):
        try:
            lp = np.asarray(logps, np.float64)
        except (TypeError, ValueError):
            lp = None
        if lp is None or lp.ndim != 1 or lp.size != ids.size:
            got = "is not a list of numbers" if lp is None or lp.ndim != 1 else f"has {lp.size}"
            raise ValueError(
                f"train_on_rollouts: sampler_logprobs[{i}] {got}: give one log-prob per "
                f"completion token ({ids.size} in completion_tokens[{i}])"
            )
        bad = np.flatnonzero(~np.isfinite(lp) | (lp > LOGPROB_TOLERANCE))
        if bad.size:
            j = int(bad[0])
            raise ValueError(
                f"train_on_rollouts: sampler_logprobs[{i}][{j}] = {lp[j]:g} is not a "
                f"log-probability (finite and <= 0; {bad.size} such value(s) in row {i}): give "
                "the sampler's log-probs of the sampled tokens, not logits or probabilities"
            )
