"""GRPO trainer (GRPO / GSPO / DAPO / Dr.GRPO): sampler → rewards → buffer → exact engine.

Per generation (shared/specs/grpo.md §3–6): the next prompts in TRL ``RepeatSampler`` order →
the KV-cache ``Sampler`` with weights synced from the trainer's parameters → completions →
reward functions → advantages on the whole generation batch (host numpy) → old / reference
log-probs when needed → the generation buffer. Per optimizer step: the window's completions
(g micro-steps of every rank, or ``docs_per_step`` documents) → ``build_dp_schedule`` as one
step → packed ``[R, K, T]`` batch → the train step, whose loss is ``policy_loss_terms`` on
``micro_batch_logprobs``. Orchestration only: the numerics live in losses/, train/, rollout/.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.config import ConfigError, GRPOConfig, RunConfig
from jaxrl.data.feed import cut_rounds
from jaxrl.data.packing import pack_micro_batches
from jaxrl.data.schedule import build_dp_schedule
from jaxrl.data.tokenizer import char_tokenizer
from jaxrl.losses.advantages import compute_advantages, reward_metrics
from jaxrl.losses.normalize import LossTerms
from jaxrl.losses.policy import policy_loss_terms
from jaxrl.models.transformer import Transformer
from jaxrl.rollout.buffer import GenerationBuffer, PromptSampler
from jaxrl.rollout.rewards import (
    RewardFunc,
    exact_answer_reward,
    resolve_reward_funcs,
    reward_name,
    score_completions,
)
from jaxrl.rollout.rollouts import Rollouts, documents_of
from jaxrl.rollout.sampler import Sampler, SamplingParams
from jaxrl.train.forward import micro_batch_logprobs
from jaxrl.train.metrics import read_metrics
from jaxrl.train.plots import plot_reward_and_accuracy
from jaxrl.train.score import Scorer
from jaxrl.trainers.session import Session, build_model, build_task, device_arrays

DEFAULT_REWARD_FUNCS = ("exact_answer", "format")
PLOT_NAME = "grpo_progress.png"
GREEDY = SamplingParams(temperature=0.0)


def grpo_loss(config: GRPOConfig, *, chunk_size: int = 0):
    """``loss(model, mb) -> LossTerms`` of one packed micro-batch, plus the sampler metric.

    ``sampler/logprob_mismatch`` is the (Σ |logp − sampler_logp|·m, Σ m) pair over loss tokens.
    """
    use_entropy_mask = config.top_entropy_quantile < 1.0

    def loss(model: Transformer, mb: dict[str, jax.Array]) -> LossTerms:
        logp_BT, entropy_BT = micro_batch_logprobs(
            model, mb, chunk_size=chunk_size, temperature=config.temperature
        )
        terms = policy_loss_terms(
            logp_BT,
            mb.get("old_logp"),
            mb.get("ref_logp"),
            mb["advantage"],
            mb["loss_mask"],
            mb["segment_ids"],
            entropy_BT,
            loss_type=config.loss_type,
            importance_sampling_level=config.importance_sampling_level,
            epsilon=config.epsilon,
            epsilon_high=config.epsilon_high,
            delta=config.delta,
            beta=config.beta,
            max_completion_length=config.max_completion_length,
            entropy_threshold=mb["entropy_threshold"][0] if use_entropy_mask else None,
        )
        m_BT = (mb["loss_mask"] > 0) & (mb["segment_ids"] > 0)
        gap_BT = jnp.where(m_BT, jnp.abs(jax.lax.stop_gradient(logp_BT) - mb["sampler_logp"]), 0.0)
        terms.metrics["sampler/logprob_mismatch"] = (
            jnp.sum(gap_BT),
            jnp.sum(m_BT.astype(jnp.float32)),
        )
        return terms

    return loss


class GRPOTrainer:
    """GRPO on a built-in task; ``run()`` trains ``max_steps`` and returns a summary.

    ``reward_funcs``: callables ``(prompts, completions, **columns) -> list[float | None]`` or
    built-in names (default: exact answer and format), weighted by ``grpo.reward_weights``.
    """

    def __init__(self, cfg: RunConfig, *, reward_funcs: Sequence[str | RewardFunc] | None = None):
        config = cfg.grpo_config or GRPOConfig(world_size=cfg.mesh.data)
        cfg = _resolve_run_config(cfg, config)
        self.cfg, self.config = cfg, config
        t = cfg.task
        task = build_task(cfg)
        self.tokenizer = tok = char_tokenizer(task.alphabet)
        self.train_examples = task.examples(t.train_size)
        self.eval_examples = task.examples(t.eval_size, split="eval")
        encode = lambda exs: [np.asarray(tok.encode(e.prompt, add_bos=True), np.int32) for e in exs]
        self.train_prompts, self.eval_prompts = (
            encode(self.train_examples),
            encode(self.eval_examples),
        )
        self.reward_funcs = resolve_reward_funcs(reward_funcs or DEFAULT_REWARD_FUNCS)
        self.reward_names = [reward_name(f) for f in self.reward_funcs]
        if config.reward_weights is not None and len(config.reward_weights) != len(
            self.reward_funcs
        ):
            raise ConfigError(
                f"grpo.reward_weights={list(config.reward_weights)} has "
                f"{len(config.reward_weights)} entries for {len(self.reward_funcs)} reward "
                f"functions {self.reward_names}: give one weight per function"
            )
        longest = max(len(p) for p in self.train_prompts + self.eval_prompts)
        if longest + config.max_completion_length > cfg.schedule.max_tokens:
            raise ConfigError(
                f"schedule.max_tokens={cfg.schedule.max_tokens} is invalid: a prompt of {longest} "
                f"tokens plus grpo.max_completion_length={config.max_completion_length} must "
                "fit one row; raise schedule.max_tokens or lower max_completion_length"
            )

        model = build_model(cfg, tok.vocab_size)
        chunk = cfg.model.logprob_chunk
        self.session = Session(cfg, model, grpo_loss(config, chunk_size=chunk))
        self.scorer = Scorer(
            self.session.graphdef,
            row_len=cfg.schedule.max_tokens,
            temperature=config.temperature,
            chunk_size=chunk,
        )
        self.sampler = Sampler(
            model.config,
            max_new_tokens=config.max_completion_length,
            eos_id=tok.eos_id,
            pad_id=tok.pad_id,
            sampling=SamplingParams(
                temperature=config.temperature, top_k=config.top_k or 0, top_p=config.top_p
            ),
        )
        # β > 0: the frozen initial parameters (a copy: the train step donates its buffers).
        self.ref_params = self._local_params(copy=True) if config.beta != 0.0 else None
        self.prompt_sampler = PromptSampler(
            len(self.train_prompts),
            prompts_per_generation=config.prompts_per_generation,
            num_generations=config.num_generations,
            shuffle=config.shuffle_dataset,
            seed=cfg.seed,
        )
        self.buffer = GenerationBuffer(config, seed=cfg.seed)
        self.rollouts: dict[int, Rollouts] = {}  # generation id → batch, while rows are pending
        self.pending: deque[tuple[int, int]] = deque()  # (generation, row) not yet trained on
        self.next_id = 0  # generation ids (internal and external batches)
        self.current_id: int | None = None  # the generation in the buffer
        self.start_accuracy: float | None = None
        self._started = False

    # -- generation ---------------------------------------------------------------------------
    @property
    def computes_old_logprobs(self) -> bool:
        """Old log-probs when a buffered row may be trained on after an update (§5), or always
        under docs_per_step (leftover documents wait for the next step)."""
        return self.config.needs_old_logprobs or self.cfg.schedule.docs_per_step > 0

    def _local_params(self, *, copy: bool = False) -> Any:
        """The trainer's parameters on one device (the sampler and scorer run unsharded)."""
        params = jax.device_put(self.session.state.params, jax.devices()[0])
        return jax.tree.map(lambda x: jnp.array(x, copy=True), params) if copy else params

    def make_rollouts(
        self,
        prompt_ids: Sequence[np.ndarray],
        completion_ids: Sequence[np.ndarray],
        sampler_logp: Sequence[np.ndarray],
        truncated: np.ndarray,
        rewards: np.ndarray,
    ) -> Rollouts:
        """A generation batch with advantages (and old/reference log-probs when needed)."""
        c = self.config
        advantages = compute_advantages(
            rewards,
            c.num_generations,
            weights=self._reward_columns(rewards.shape[1])[0],
            scale_rewards=c.scale_rewards,
            mode=c.multi_objective_aggregation,
        )
        r = Rollouts(
            prompt_ids=[np.asarray(p, np.int32) for p in prompt_ids],
            completion_ids=[np.asarray(x, np.int32) for x in completion_ids],
            sampler_logp=[np.asarray(x, np.float32) for x in sampler_logp],
            truncated=np.asarray(truncated, bool),
            rewards=rewards,
            advantages=advantages,
        )
        sequences = documents_of([(r, i) for i in range(len(r))], mask_truncated=False).sequences
        cut = lambda per_doc: [lp[len(p) :] for lp, p in zip(per_doc, r.prompt_ids, strict=True)]
        if self.computes_old_logprobs:
            r.old_logp = cut(self.scorer.token_logprobs(self._local_params(), sequences))
        if self.ref_params is not None:
            r.ref_logp = cut(self.scorer.token_logprobs(self.ref_params, sequences))
        return r

    def generate(self) -> dict[str, Any]:
        """Generate, score and keep the next generation batch; returns the buffer's fields."""
        n = self.prompt_sampler.generations
        idx = self.prompt_sampler.next_generation()
        self.sampler.load_params(self._local_params())  # the one weight sync, every generation
        key = jax.random.fold_in(jax.random.key(self.cfg.seed), n)
        res = self.sampler.generate([self.train_prompts[i] for i in idx], key)
        completions = res.completions()
        examples = [self.train_examples[i] for i in idx]
        rewards = score_completions(
            self.reward_funcs,
            [e.prompt for e in examples],
            [self.tokenizer.decode(x) for x in completions],
            {"answer": [e.answer for e in examples]},
        )
        logps = [res.logprobs[b, : len(x)] for b, x in enumerate(completions)]
        rollouts = self.make_rollouts(
            [self.train_prompts[i] for i in idx], completions, logps, res.truncated, rewards
        )
        gen = self._keep(rollouts)
        self.current_id = gen
        return {"row": np.arange(len(idx)), "generation": np.asarray(gen)}

    def _keep(self, rollouts: Rollouts) -> int:
        gen, self.next_id = self.next_id, self.next_id + 1
        self.rollouts[gen] = rollouts
        return gen

    def _micro_step(self) -> None:
        if self.buffer.needs_generation:
            self.buffer.load(self.generate())
        for chunk in self.buffer.serve():  # every rank's chunk k % S
            gen = int(chunk["generation"])
            self.pending.extend((gen, int(r)) for r in chunk["row"])

    # -- training -----------------------------------------------------------------------------
    def step(self) -> dict[str, Any]:
        """One optimizer step on the next window (g micro-steps, or docs_per_step documents)."""
        self._start()
        target = self.cfg.schedule.docs_per_step
        if target == 0:
            for _ in range(self.config.gradient_accumulation_steps):
                self._micro_step()
        while len(self.pending) < target:
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
        r_BF = np.asarray(
            [[np.nan if v is None else v for v in np.atleast_1d(row)] for row in rewards],
            np.float64,
        )
        if truncated is None:
            eos = self.tokenizer.eos_id
            truncated = [len(c) == 0 or int(c[-1]) != eos for c in completion_tokens]
        rollouts = self.make_rollouts(
            [np.asarray(p) for p in prompt_tokens],
            [np.asarray(c) for c in completion_tokens],
            [np.asarray(x) for x in sampler_logprobs],
            np.asarray(truncated, bool),
            r_BF,
        )
        gen = self._keep(rollouts)
        self.pending.extend((gen, i) for i in range(len(rollouts)))
        target = self.cfg.schedule.docs_per_step
        if len(self.pending) < target:
            raise ValueError(
                f"schedule.docs_per_step={target} but only {len(self.pending)} rollouts are "
                "available: submit at least that many (they are kept for the next call)"
            )
        row = self._train_pending()
        self.session.writer.write(row)
        return row

    def _train_pending(self) -> dict[str, Any]:
        """Schedule, pack and train on the pending rows (the docs_per_step cut keeps the rest)."""
        cfg, c = self.cfg, self.config
        rows = list(self.pending)
        docs = documents_of(
            [(self.rollouts[g], r) for g, r in rows], mask_truncated=c.mask_truncated_completions
        )
        s = cfg.schedule
        micro = build_dp_schedule(
            [len(x) for x in docs.sequences],
            dp_size=cfg.mesh.data,
            max_tokens=s.max_tokens,
            packing=s.packing,
            balance=s.balance,
        ).steps[0]
        if micro.dropped_rollout_ids:
            raise RuntimeError(f"internal error: the schedule dropped {micro.dropped_rollout_ids}")
        micro_batches = micro.micro_batches
        if s.docs_per_step:
            rounds = cut_rounds(micro_batches, s.docs_per_step)
            micro_batches = [rank[:rounds] for rank in micro_batches]
        used = sorted(i for rank in micro_batches for mb in rank for i in mb)
        used_set = set(used)
        self.pending = deque(row for i, row in enumerate(rows) if i not in used_set)
        packed = pack_micro_batches(
            micro_batches,
            docs.sequences,
            loss_masks=docs.loss_masks,
            token_fields=docs.token_fields,
            doc_fields={"advantage": docs.advantages},
            row_len=s.max_tokens,
        )
        arrays = device_arrays(packed, extra=(*docs.token_fields, "advantage"))
        if c.top_entropy_quantile < 1.0:  # no-grad pre-pass over the whole step, all ranks
            tau = self.scorer.step_entropy_threshold(
                self.session.state.params, arrays, c.top_entropy_quantile
            )
            arrays["entropy_threshold"] = np.full(packed.num_docs.shape, tau, np.float32)
        row = self.session.run_step(
            arrays, expected_documents=len(used), rounds=packed.num_micro_batches
        )
        gens = sorted({rows[i][0] for i in used})
        row.update(self._generation_metrics(gens))
        keep = {g for g, _ in self.pending} | {self.current_id}
        self.rollouts = {g: r for g, r in self.rollouts.items() if g in keep}
        return row

    def _reward_columns(self, num_columns: int) -> tuple[Any, list[str]]:
        """(weights, names) of a reward matrix: the reward functions' when the width matches
        (internal generations, or external ``[B, F]`` rewards), else one unweighted column."""
        if num_columns == len(self.reward_funcs):
            return self.config.reward_weights, self.reward_names
        if num_columns == 1:
            return None, ["external"]
        raise ValueError(
            f"rewards have {num_columns} columns: give [B] or [B, {len(self.reward_funcs)}] "
            f"(one column per reward function {self.reward_names})"
        )

    def _generation_metrics(self, gens: list[int]) -> dict[str, float]:
        """Reward and length metrics over the generation batches the step's rows came from."""
        c = self.config
        batches = [self.rollouts[g] for g in gens]
        weights, names = self._reward_columns(batches[0].rewards.shape[1])
        out = reward_metrics(
            [b.rewards for b in batches],
            c.num_generations,
            weights=weights,
            scale_rewards=c.scale_rewards,
            mode=c.multi_objective_aggregation,
            reward_names=names,
        )
        lengths = np.concatenate([b.completion_lengths for b in batches])
        truncated = np.concatenate([b.truncated for b in batches])
        out["completions/mean_length"] = float(lengths.mean())
        out["completions/max_length"] = float(lengths.max())
        out["completions/clipped_ratio"] = float(truncated.mean())
        return out

    # -- evaluation, state, the loop ----------------------------------------------------------
    def evaluate(self) -> float:
        """Held-out accuracy: greedy completions scored by the exact-answer reward."""
        self.sampler.load_params(self._local_params())
        res = self.sampler.generate(self.eval_prompts, jax.random.key(0), GREEDY)
        exs = self.eval_examples
        completions = [self.tokenizer.decode(x) for x in res.completions()]
        scores = exact_answer_reward(
            [e.prompt for e in exs], completions, answer=[e.answer for e in exs]
        )
        return float(np.mean(scores))

    def host_state(self) -> dict[str, Any]:
        """Everything outside the TrainState that a resumed run needs, as JSON."""
        return {
            "prompt_sampler": self.prompt_sampler.state_dict(),
            "buffer": self.buffer.state_dict(),
            "rollouts": {str(g): r.to_json() for g, r in self.rollouts.items()},
            "pending": [list(x) for x in self.pending],
            "next_id": self.next_id,
            "current_id": self.current_id,
            "start_accuracy": self.start_accuracy,
        }

    def _start(self) -> None:
        """Resume from the newest checkpoint (or measure the starting accuracy); once."""
        if self._started:
            return
        self._started = True
        host = self.session.resume({})
        if host is None:
            self.start_accuracy = self.evaluate()
            return
        self.prompt_sampler.load_state_dict(host["prompt_sampler"])
        self.buffer.load_state_dict(host["buffer"])
        self.rollouts = {int(g): Rollouts.from_json(r) for g, r in host["rollouts"].items()}
        self.pending = deque((int(g), int(r)) for g, r in host["pending"])
        self.next_id, self.current_id = int(host["next_id"]), host["current_id"]
        self.start_accuracy = host["start_accuracy"]

    def run(self) -> dict[str, Any]:
        """Train to ``max_steps`` (resuming if a checkpoint exists); returns a summary."""
        cfg, session = self.cfg, self.session
        self._start()
        start = time.perf_counter()
        last: dict[str, Any] = {}
        with session.progress("grpo") as advance:
            while session.step < cfg.max_steps:
                row = self.step()
                every = cfg.logging.eval_every
                if (every and session.step % every == 0) or session.step == cfg.max_steps:
                    row["eval/accuracy"] = self.evaluate()
                session.writer.write(row)
                session.maybe_checkpoint(self.host_state(), force=session.step == cfg.max_steps)
                advance(f"reward {row['reward']:.3f}")
                last = row
        plot = plot_reward_and_accuracy(
            read_metrics(session.writer.path),
            session.output_dir / PLOT_NAME,
            start_accuracy=self.start_accuracy,
        )
        export = session.export(self.tokenizer)
        session.close()
        final = last.get("eval/accuracy")
        return {
            "steps": session.step,
            "final_loss": last.get("loss"),
            "eval/accuracy_start": self.start_accuracy,
            "eval/accuracy": final if final is not None else self.evaluate(),
            "wall_s": round(time.perf_counter() - start, 1),
            "plot": str(plot),
            "hf_export": str(export),
        }


def _resolve_run_config(cfg: RunConfig, config: GRPOConfig) -> RunConfig:
    """Apply the GRPO section's run-level settings: ``learning_rate`` (the GRPO stage's peak; the
    SFT warm start keeps ``optimizer.learning_rate``), ``fp32_lm_head`` (the model's head), and
    ``docs_per_step`` (one setting with ``schedule.docs_per_step``, which the engine reads)."""
    mine, theirs = config.docs_per_step, cfg.schedule.docs_per_step
    if mine and theirs and mine != theirs:
        raise ConfigError(
            f"grpo.docs_per_step={mine} and schedule.docs_per_step={theirs} disagree: set one"
        )
    changes: dict[str, Any] = {}
    if mine and not theirs:
        changes["schedule"] = dataclasses.replace(cfg.schedule, docs_per_step=mine)
    if config.learning_rate is not None:
        changes["optimizer"] = dataclasses.replace(
            cfg.optimizer, learning_rate=config.learning_rate
        )
    if config.fp32_lm_head and not cfg.model.fp32_lm_head:
        changes["model"] = dataclasses.replace(cfg.model, fp32_lm_head=True)
    return dataclasses.replace(cfg, **changes) if changes else cfg
