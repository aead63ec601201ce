"""Rollouts from prompts: weight sync → KV-cache sampler → rewards → advantages → old/ref log-probs.

The generator holds the sampler (the rollout backend ``rollout.backend`` names, built by
``backends.build_backend``), the no-grad scorer and the reward functions of a GRPO run. Every call
takes the parameters explicitly and loads them into the backend through its sync policy
(``weight_sync.WeightSync``: every version, or every ``rollout.sync_every`` for vLLM), so
generation uses the trainer's current weights or, between vLLM syncs, the version it says. With a
``mesh``, sampling and scoring split their rows over its batch axes and use the parameters in
their own sharding. Rewards and advantages are computed on the whole generation batch on the
host (as TRL's GRPOTrainer).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh

from jaxrl.config import ConfigError, GRPOConfig, RolloutConfig
from jaxrl.data.tokenizer import TextTokenizer
from jaxrl.generate.backend import RolloutBackend
from jaxrl.generate.decode_layout import sampler_mesh
from jaxrl.generate.sampler import SamplingParams
from jaxrl.losses.advantages import (
    aggregate_rewards,
    compute_advantages,
    kl_in_reward_advantages,
    reward_metrics,
)
from jaxrl.models import lora
from jaxrl.models.model_config import ModelConfig
from jaxrl.models.moe.trace import route_fields
from jaxrl.rollout.backends import BackendSpec, build_backend, weight_sync
from jaxrl.rollout.episodes import EpisodeRows, EpisodeRunner, episode_metrics
from jaxrl.rollout.rewards.compute import (
    RewardFunc,
    TrainingProgress,
    reward_inputs,
    reward_names,
    score_once,
)
from jaxrl.rollout.rollout_queue import RolloutBatch
from jaxrl.train.forward import ROUTE_REPLAY
from jaxrl.train.score import Scorer

__all__ = ["RolloutGenerator"]


class Sampled(NamedTuple):
    """Sampled and scored rows, not yet a :class:`RolloutBatch` (``RolloutGenerator.build``'s
    arguments after ``params``)."""

    prompt_ids: list[np.ndarray]
    completion_ids: list[np.ndarray]
    sampler_logp: list[np.ndarray]
    truncated: np.ndarray
    rewards_BW: np.ndarray
    episodes: EpisodeRows | None = None  # tool episodes: environment-token masks, statistics
    routes: list[np.ndarray] | None = None  # MoE: the sampler's expert ids [P + C, Lm, K]

    def rows(self, keep: np.ndarray) -> Sampled:
        """The rows where ``keep`` ([B] bool) is set, in order."""
        idx = np.flatnonzero(keep)
        pick = lambda xs: [xs[i] for i in idx]
        return Sampled(
            pick(self.prompt_ids),
            pick(self.completion_ids),
            pick(self.sampler_logp),
            self.truncated[idx],
            self.rewards_BW[idx],
            None if self.episodes is None else self.episodes.rows(idx),
            None if self.routes is None else pick(self.routes),
        )

    @staticmethod
    def concat(parts: Sequence[Sampled]) -> Sampled:
        return Sampled(
            [x for p in parts for x in p.prompt_ids],
            [x for p in parts for x in p.completion_ids],
            [x for p in parts for x in p.sampler_logp],
            np.concatenate([p.truncated for p in parts]),
            np.concatenate([p.rewards_BW for p in parts]),
            None if parts[0].episodes is None else EpisodeRows.concat([p.episodes for p in parts]),
            None if parts[0].routes is None else [x for p in parts for x in p.routes],
        )


class RolloutGenerator:
    """Sampler + scorer + reward functions of one GRPO run (host orchestration, no state)."""

    def __init__(
        self,
        config: GRPOConfig,
        model_config: ModelConfig,
        graphdef: Any,
        tokenizer: TextTokenizer,
        *,
        reward_funcs: Sequence[RewardFunc],
        row_len: int,
        chunk_size: int = 0,
        old_logprobs: bool = False,
        ref_params: Any = None,
        mesh: Mesh | None = None,
        episodes: EpisodeRunner | None = None,
        rollout: RolloutConfig | None = None,
        copy_params: bool = True,
        log_dir: str | None = None,
    ):
        """``reward_funcs``: the loaded functions (``jaxrl.rollout.rewards.specs``);
        ``old_logprobs``: score every batch under the generating parameters
        (docs/algorithms/grpo.md §5); ``ref_params``: the frozen reference parameters when
        β > 0; ``mesh``: the device mesh the sampler and the scorer split their rows over (None:
        where the parameters are); ``episodes``: multi-turn episodes with tools (docs/tools.md;
        None: one completion per prompt); ``rollout``: the sampler's decode slots
        (``max_slots``, 0 = one per completion) and its decode layout on ``mesh``'s devices
        (``tensor_parallel``, auto from ``weight_budget_gb``: ``jaxrl.generate.decode_layout``;
        None: the defaults); ``copy_params``: whether the sampler copies the weights at each
        sync (needed when generation overlaps training; docs/rollout.md); ``log_dir``: where a
        vLLM server that jaxrl starts writes its log (``rollout.backend: vllm``)."""
        self.config = config
        self._phases: dict[str, float] = {}  # seconds per phase since the last metrics row
        self.episodes = episodes
        self.tokenizer = tokenizer
        self.reward_funcs = list(reward_funcs)
        self.reward_names = reward_names(self.reward_funcs)
        weights = config.reward_weights
        if weights is not None and len(weights) != len(self.reward_funcs):
            raise ConfigError(
                f"grpo.reward_weights={list(weights)} has {len(weights)} entries for "
                f"{len(self.reward_funcs)} reward functions {self.reward_names}: give one weight "
                "per function"
            )
        self.old_logprobs = old_logprobs
        self.ref_params = ref_params
        self.lora_graphdef = graphdef if model_config.lora is not None else None
        rollout = rollout or RolloutConfig()
        dense = lora.dense_config(model_config)  # LoRA: samples with the merged weights
        decoding = None  # the sampler's own layout over the same devices
        if mesh is not None:
            decoding = sampler_mesh(mesh, dense, rollout.tensor_parallel, rollout.weight_budget_gb)
        sampling = SamplingParams(
            temperature=config.temperature, top_k=config.top_k or 0, top_p=config.top_p
        )
        spec = BackendSpec(
            config=dense,
            rollout=rollout,
            max_new_tokens=config.max_completion_length,
            eos_id=tokenizer.eos_id,
            pad_id=tokenizer.pad_id,
            sampling=sampling,
            max_model_len=row_len,
            mesh=decoding,
            copy_params=copy_params,
            log_dir=log_dir,
        )
        self.sampler: RolloutBackend = build_backend(spec)  # rollout.backend's (backends.py)
        self.weight_sync = weight_sync(self.sampler, rollout)  # rollout.sync_every
        self.scorer = Scorer(
            graphdef,
            mesh=mesh,
            row_len=row_len,
            temperature=config.temperature,
            chunk_size=chunk_size,
        )

    @contextlib.contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        """Time a phase of making a generation (``time/<name>_s`` in the next metrics row):
        sync (weights to the sampler), sampling, rewards, scoring (old / reference log-probs)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._phases[name] = self._phases.get(name, 0.0) + time.perf_counter() - start

    def reward_columns(self, num_columns: int) -> tuple[Any, list[str]]:
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

    def build(
        self,
        params: Any,
        prompt_ids: Sequence[np.ndarray],
        completion_ids: Sequence[np.ndarray],
        sampler_logp: Sequence[np.ndarray],
        truncated: np.ndarray,
        rewards_BW: np.ndarray,
        episodes: EpisodeRows | None = None,
        routes: Sequence[np.ndarray] | None = None,
    ) -> RolloutBatch:
        """A generation batch with its documents and advantages, and old / reference log-probs
        when needed (scored on the batch's documents).

        ``params`` are the parameters that generated the batch (for old log-probs).
        ``routes``: a MoE sampler's recorded expert ids per row, carried as token fields (and
        replayed by the training forward and the old log-probs' scoring forward with
        ``grpo.router_replay: rollout``; the reference model routes itself; docs/moe.md).
        """
        c = self.config
        advantages_B = compute_advantages(
            rewards_BW,
            c.num_generations,
            weights=self.reward_columns(rewards_BW.shape[1])[0],
            scale_rewards=c.scale_rewards,
            mode=c.multi_objective_aggregation,
            estimator=c.advantage_estimator,
        )
        batch = RolloutBatch.build(
            prompt_ids,
            completion_ids,
            sampler_logp,
            truncated,
            rewards_BW,
            advantages_B,
            mask_truncated=c.mask_truncated_completions,
            completion_masks=None if episodes is None else episodes.masks,
            episode_stats=None if episodes is None else episodes.stats,
        )
        replayed = None  # router replay: the old log-probs' forward replays the routes too
        if routes is not None:
            add_route_fields(batch, routes, replay=c.router_replay == "rollout")
            if c.router_replay == "rollout":
                replayed = {k: v for k, v in batch.token_fields.items() if k.startswith("moe_")}
        shared = {}  # shared prompts: one copy per row (docs/algorithms/grpo.md §12)
        if c.shared_prompt_packing:
            shared = dict(prompt_lengths=batch.prompt_lengths, loss_masks=batch.loss_masks)
        if self.old_logprobs:
            with self._phase("scoring"):
                old = self.scorer.token_logprobs(
                    params, batch.sequences, token_fields=replayed, **shared
                )
            batch.set_completion_field("old_logp", _completion_parts(old, batch.prompt_lengths))
        if self.ref_params is not None:
            with self._phase("scoring"):
                ref = self.scorer.token_logprobs(self.ref_params, batch.sequences, **shared)
            batch.set_completion_field("ref_logp", _completion_parts(ref, batch.prompt_lengths))
        if c.kl_in_reward:  # REINFORCE++: per-token returns with −β·KL, whitened
            masks = _completion_parts(batch.loss_masks, batch.prompt_lengths)
            token_adv = kl_in_reward_advantages(
                aggregate_rewards(rewards_BW, self.reward_columns(rewards_BW.shape[1])[0]),
                batch.old_logp,
                batch.ref_logp,
                masks,
                c.beta,
            )
            batch.set_completion_field("token_advantage", token_adv)
            # the row's advantage (metrics, clip counts at sequence level): its first token's
            batch.advantages = np.asarray([a[0] if len(a) else 0.0 for a in token_adv], np.float32)
        return batch

    def sample(
        self,
        params: Any,
        prompt_ids: Sequence[np.ndarray],
        prompts: Sequence[Any],
        columns: Mapping[str, Sequence[Any]],
        key: jax.Array,
        trainer_state: TrainingProgress | None = None,
    ) -> Sampled:
        """Sample one completion per prompt row with ``params`` and score it: ``(prompt_ids,
        completions, sampler log-probs, truncated, rewards [B, W])`` in row order, the arguments
        of :meth:`build` after ``params``.

        ``prompts`` (text, or lists of messages) and ``columns`` (the dataset's other fields,
        one value per row) reach the reward functions as TRL passes them
        (``jaxrl.rollout.rewards.compute``), with the completions' ids and ``trainer_state``.
        """
        version = None if trainer_state is None else trainer_state.global_step
        # the one weight sync; the version (optimizer updates taken) tags the samples
        with self._phase("sync"):
            if self.weight_sync.due(version):  # rollout.sync_every may keep the older weights
                self.weight_sync.load(self.sampler_params(params), version)
        if self.episodes is not None:  # multi-turn episodes with tools (docs/tools.md)
            with self._phase("sampling"):
                ep = self.episodes.sample(self.sampler, prompt_ids, prompts, columns, key)
            with self._phase("rewards"):
                rewards_BW = score_once(  # process 0 scores, every process gets them
                    self.reward_funcs,
                    list(prompts),
                    ep.reward_completions,
                    ep.columns,
                    completion_ids=ep.completions,
                    trainer_state=trainer_state,
                    timeout=self.config.reward_timeout,
                )
            return Sampled(
                list(prompt_ids), ep.completions, ep.logps, ep.truncated, rewards_BW, ep.rows,
                routes=ep.routes,
            )  # fmt: skip
        with self._phase("sampling"):
            res = self.sampler.generate(list(prompt_ids), key)
            completions = res.completions()
        with self._phase("rewards"):
            reward_prompts, texts = reward_inputs(
                prompts, [self.tokenizer.decode(x) for x in completions]
            )
            rewards_BW = score_once(  # process 0 scores, every process gets them
                self.reward_funcs,
                reward_prompts,
                texts,
                columns,
                completion_ids=completions,
                trainer_state=trainer_state,
                timeout=self.config.reward_timeout,
            )
        logps = [res.logprobs[b, : len(x)] for b, x in enumerate(completions)]
        return Sampled(
            list(prompt_ids),
            completions,
            logps,
            np.asarray(res.truncated),
            rewards_BW,
            routes=res.routes,
        )

    def precompile(self, prompt_ids: Sequence[np.ndarray]) -> None:
        """Compile ahead, on a background thread, the sampler program of a later
        :meth:`sample` of these prompt rows (``Sampler.precompile``); tool episodes run
        session programs of their own, so nothing then."""
        if self.episodes is None:
            self.sampler.precompile(list(prompt_ids))

    def sampler_params(self, params: Any) -> Any:
        """What the sampler loads: ``params``, or a LoRA model merged (``lora.merged_state``)."""
        if self.lora_graphdef is None:
            return params
        return lora.merged_state(self.lora_graphdef, params, self.sampler.config.dtype)

    def close(self) -> None:
        """Release what the rollout backend holds outside this process (vLLM servers)."""
        self.sampler.close()

    def metrics(self, batches: Sequence[RolloutBatch]) -> dict[str, float]:
        """Reward and completion-length metrics over whole generation batches (rows pooled)."""
        c = self.config
        weights, names = self.reward_columns(batches[0].rewards.shape[1])
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
        phases, self._phases = self._phases, {}  # seconds per phase since the last row
        out.update({f"time/{name}_s": seconds for name, seconds in phases.items()})
        out.update(self.sampler.metrics())  # vLLM: weight-sync time, requests per server
        stats = [b.episode_stats for b in batches if b.episode_stats is not None]
        if stats:  # tool episodes (external rollouts have none)
            out.update(episode_metrics(stats))
        return out


def _completion_parts(doc_logps: list[np.ndarray], prompt_lengths: np.ndarray) -> list[np.ndarray]:
    """The completion tokens' part of token-aligned per-document values."""
    return [lp[int(p) :] for lp, p in zip(doc_logps, prompt_lengths, strict=True)]


def add_route_fields(batch: RolloutBatch, routes: Sequence[np.ndarray], *, replay: bool) -> None:
    """A MoE sampler's recorded routes into ``batch``'s token fields (``moe/trace.py``), and
    with ``replay`` the flag field that makes the training forward replay them."""
    fields: dict[str, list[np.ndarray]] = {}
    for seq, row in zip(batch.sequences, routes, strict=True):
        for name, values in route_fields(row, len(seq)).items():
            fields.setdefault(name, []).append(values)
    if replay:
        fields[ROUTE_REPLAY] = [np.ones(len(seq), np.float32) for seq in batch.sequences]
    batch.token_fields.update(fields)
