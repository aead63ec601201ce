"""``GRPOConfig``: TRL's GRPO fields and defaults, resolved and validated at construction.

Field names, defaults and the resolution order follow huggingface/trl after PR #3388/#3725.
``generation_batch_size`` and ``steps_per_generation`` hold their resolved values after
construction; ``replace`` rebuilds from the values the user gave. The accepted loss types,
importance-sampling levels, reward scalings and aggregations are the lists the loss code itself
checks (``jaxrl.losses.loss_types``, ``jaxrl.losses.advantages``), imported, not copied.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jaxrl.config.base import ConfigError, require, require_choice
from jaxrl.losses.advantages import AGGREGATIONS, SCALE_REWARDS
from jaxrl.losses.loss_types import (
    GRPO_LOSS_TYPES,
    IMPORTANCE_SAMPLING_LEVELS,
    TOKEN_SUMMING_LOSS_TYPES,
)

EVAL_STRATEGIES = ("no", "steps", "epoch")
LR_SCHEDULER_TYPES = ("constant", "cosine", "linear")  # the GRPO stage's decay after warmup


def reward_file_spec(spec: str) -> tuple[str, str] | None:
    """``(path, function)`` of a ``"path/to/file.py:function"`` reward entry, else None."""
    path, sep, func = spec.rpartition(":")
    return (path, func) if sep and path.endswith(".py") else None


def anchor_reward_paths(data: dict[str, Any], base_dir: str | Path) -> dict[str, Any]:
    """Make the relative ``file.py:function`` entries of a YAML dict's ``grpo.reward_funcs``
    relative to ``base_dir`` (the YAML file's directory), in place; returns ``data``. Entries
    given later (``--set``) stay relative to the current directory."""
    section = data.get("grpo")
    funcs = section.get("reward_funcs") if isinstance(section, dict) else None
    if not isinstance(funcs, list):
        return data
    for i, spec in enumerate(funcs):
        parts = reward_file_spec(spec) if isinstance(spec, str) else None
        if parts and not Path(parts[0]).is_absolute():
            funcs[i] = f"{Path(base_dir) / parts[0]}:{parts[1]}"
    return data


def _positive_int(field: str, value: Any) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
    require(ok, field, value, "use an integer ≥ 1")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GRPOConfig:
    """GRPO / GSPO / DAPO / Dr.GRPO algorithm settings (TRL names)."""

    per_device_train_batch_size: int = 8  # b: completions per rank per micro-step
    gradient_accumulation_steps: int = 1  # g: micro-steps per optimizer step
    world_size: int = 1  # P: data-parallel size (the loader sets it from mesh.data)
    num_generations: int = 8  # G: completions per prompt, ≥ 2
    num_generations_eval: int | None = None  # eval group size; None → num_generations
    generation_batch_size: int | None = None  # B_gen: completions per generation, all ranks
    steps_per_generation: int | None = None  # S: micro-steps served by one generation buffer
    num_iterations: int = 1  # μ: passes over each generation buffer
    shuffle_dataset: bool = True  # permute the prompt order each epoch
    max_completion_length: int = 512  # generation cap; also Dr.GRPO's constant
    max_prompt_length: int | None = 512  # longer prompts keep their last tokens; None = no cap
    temperature: float = 1.0  # sampling temperature; training logits are divided by it too
    top_k: int | None = None  # sample from the k most likely tokens; None or 0 = off
    top_p: float = 1.0  # nucleus sampling mass in (0, 1]; 1 = off
    epsilon: float = 0.2  # ε_low: lower clip width
    epsilon_high: float | None = None  # ε_high: upper clip width; None → epsilon
    delta: float | None = None  # cap on the unclipped ratio (two-sided clipping), > 1
    beta: float = 0.0  # KL coefficient; 0 → no reference model
    loss_type: str = "dapo"  # grpo, bnpo, dr_grpo, dapo, seq_mean_token_sum
    importance_sampling_level: str = "token"  # token, or sequence (GSPO)
    scale_rewards: str | bool = "group"  # group, batch, none; True → group, False → none
    reward_funcs: tuple[str | dict[str, Any] | Callable[..., Any], ...] | None = None  # None →
    # the trainer's default; built-in names, {name: ..., params}, "pkg.mod:fn", "file.py:fn"
    reward_weights: tuple[float, ...] | None = None  # one weight per reward function; None → 1
    reward_timeout: float | None = 300.0  # seconds one reward function call may take; then the
    # run stops naming the function and rows (a hung call cannot be stopped); None = no limit
    multi_objective_aggregation: str = "sum_then_normalize"  # or normalize_then_sum
    mask_truncated_completions: bool = False  # completions without EOS get no loss
    top_entropy_quantile: float = 1.0  # q: keep the top-q entropy tokens in the policy loss
    per_device_eval_batch_size: int = 8  # eval completions per rank
    do_eval: bool = False  # run evaluation
    eval_strategy: str = "no"  # no, steps, epoch
    auto_find_batch_size: bool = False  # accepted only as False (would break prompt groups)
    docs_per_step: int = 0  # global documents per optimizer step; 0 = off (Fast-LLM's)
    learning_rate: float | None = None  # GRPO-stage peak LR; None → optimizer.learning_rate
    warmup_steps: int | None = None  # GRPO-stage LR warmup steps; None → optimizer.warmup_steps
    lr_scheduler_type: str | None = None  # constant, cosine, linear; None → optimizer.decay
    fp32_lm_head: bool = False  # fp32 logits from the bf16 body

    _given: tuple[int | None, int | None] = dataclasses.field(
        init=False, repr=False, compare=False, default=(None, None)
    )
    _reward_callables: tuple[Callable[..., Any], ...] | None = dataclasses.field(
        init=False, repr=False, compare=False, default=None
    )

    def __post_init__(self) -> None:
        given = (self.generation_batch_size, self.steps_per_generation)
        object.__setattr__(self, "_given", given)
        set_ = lambda name, value: object.__setattr__(self, name, value)

        # 1. scale_rewards booleans.
        if self.scale_rewards is True:
            set_("scale_rewards", "group")
        elif self.scale_rewards is False:
            set_("scale_rewards", "none")

        # 2. auto_find_batch_size.
        require(
            self.auto_find_batch_size is False,
            "auto_find_batch_size",
            self.auto_find_batch_size,
            "set it to False: shrinking the batch on OOM would break prompt groups "
            "(TRL PR #6411); lower schedule.max_tokens instead",
        )

        # 3. Batch resolution (b, P and g must be usable first).
        _positive_int("per_device_train_batch_size", self.per_device_train_batch_size)
        _positive_int("world_size", self.world_size)
        _positive_int("gradient_accumulation_steps", self.gradient_accumulation_steps)
        b_global = self.per_device_train_batch_size * self.world_size
        b_gen, steps = given
        if b_gen is not None and steps is not None:
            raise ConfigError(
                f"generation_batch_size={b_gen!r} and steps_per_generation={steps!r}: "
                "'generation_batch_size' and 'steps_per_generation' can not be both configured "
                "at the same time; set only one of them"
            )
        if b_gen is None and steps is None:
            steps = self.gradient_accumulation_steps
            b_gen = b_global * steps
        elif b_gen is not None:
            _positive_int("generation_batch_size", b_gen)
            require(
                b_gen % b_global == 0,
                "generation_batch_size",
                b_gen,
                f"it must be divisible by the global batch size per_device_train_batch_size × "
                f"world_size = {self.per_device_train_batch_size} × {self.world_size} = "
                f"{b_global}; use a multiple of {b_global}",
            )
            steps = b_gen // b_global
        else:
            _positive_int("steps_per_generation", steps)
            b_gen = b_global * steps
        set_("generation_batch_size", b_gen)
        set_("steps_per_generation", steps)

        # 4. Evaluation batches hold whole groups.
        if self.do_eval and self.eval_strategy != "no":
            n_eval = self.num_generations_eval or self.num_generations
            _positive_int(
                "num_generations_eval" if self.num_generations_eval else "num_generations", n_eval
            )
            eval_global = self.per_device_eval_batch_size * self.world_size
            require(
                eval_global % n_eval == 0,
                "per_device_eval_batch_size",
                self.per_device_eval_batch_size,
                f"the global eval batch per_device_eval_batch_size × world_size = {eval_global} "
                f"must be divisible by the eval group size {n_eval} (num_generations_eval or "
                "num_generations); change one of them",
            )

        # 5. The generation batch holds whole prompt groups.
        g_count = self.num_generations
        if isinstance(g_count, int) and g_count >= 1:
            require(
                b_gen % g_count == 0,
                "generation_batch_size",
                b_gen,
                f"it must be divisible by num_generations={g_count} so that a generation holds "
                "whole prompt groups; change generation_batch_size (or b, world_size, "
                "steps_per_generation) or num_generations",
            )

        # 6. Groups need at least 2 completions.
        require(
            isinstance(g_count, int) and not isinstance(g_count, bool) and g_count >= 2,
            "num_generations",
            g_count,
            "GRPO needs at least 2 generations per prompt; set num_generations ≥ 2",
        )

        # 7. Enumerations and ranges.
        require_choice("loss_type", self.loss_type, GRPO_LOSS_TYPES)
        require_choice(
            "importance_sampling_level", self.importance_sampling_level, IMPORTANCE_SAMPLING_LEVELS
        )
        require_choice("scale_rewards", self.scale_rewards, SCALE_REWARDS)
        require_choice(
            "multi_objective_aggregation", self.multi_objective_aggregation, AGGREGATIONS
        )
        require_choice("eval_strategy", self.eval_strategy, EVAL_STRATEGIES)
        if self.max_prompt_length is not None:
            _positive_int("max_prompt_length", self.max_prompt_length)
        for name in ("num_iterations", "max_completion_length", "per_device_eval_batch_size"):
            _positive_int(name, getattr(self, name))
        if self.num_generations_eval is not None:
            _positive_int("num_generations_eval", self.num_generations_eval)
        require(self.temperature > 0, "temperature", self.temperature, "use a value > 0")
        if self.top_k is not None:
            ok = isinstance(self.top_k, int) and not isinstance(self.top_k, bool)
            require(ok and self.top_k >= 0, "top_k", self.top_k, "use an integer ≥ 0 (0 = off)")
        require(0 < self.top_p <= 1, "top_p", self.top_p, "use a value in (0, 1]; 1 disables it")
        for name in ("epsilon", "epsilon_high", "beta"):
            value = getattr(self, name)
            if value is not None:
                require(value >= 0, name, value, "use a value ≥ 0")
        if self.learning_rate is not None:
            require(self.learning_rate > 0, "learning_rate", self.learning_rate, "use a value > 0")
        if self.warmup_steps is not None:
            require(self.warmup_steps >= 0, "warmup_steps", self.warmup_steps, "use a value >= 0")
        if self.lr_scheduler_type is not None:
            require_choice("lr_scheduler_type", self.lr_scheduler_type, LR_SCHEDULER_TYPES)
        q = self.top_entropy_quantile
        require(0 < q <= 1, "top_entropy_quantile", q, "use a value in (0, 1]; 1 disables it")
        if self.delta is not None:
            require(self.delta > 1, "delta", self.delta, "use a value > 1, or None to disable")
        docs = self.docs_per_step
        ok = isinstance(docs, int) and not isinstance(docs, bool) and docs >= 0
        require(ok, "docs_per_step", docs, "use an integer ≥ 0 (0 = off)")
        if self.reward_timeout is not None:
            require(
                self.reward_timeout > 0,
                "reward_timeout",
                self.reward_timeout,
                "use a number of seconds > 0, or None for no limit",
            )
        if self.reward_weights is not None:
            require(
                len(self.reward_weights) > 0,
                "reward_weights",
                self.reward_weights,
                "give one weight per reward function, or None for all 1",
            )
        if self.reward_funcs is not None:
            from jaxrl.rollout.reward_specs import resolve_reward_funcs

            funcs = resolve_reward_funcs(
                self.reward_funcs, max_completion_length=self.max_completion_length
            )
            set_("_reward_callables", tuple(funcs))
            weights = self.reward_weights
            if weights is not None and len(weights) != len(funcs):
                raise ConfigError(
                    f"reward_weights={list(weights)} has {len(weights)} entries but "
                    f"reward_funcs has {len(funcs)}: give one weight per reward function"
                )

        if (
            self.importance_sampling_level == "sequence"
            and self.loss_type in TOKEN_SUMMING_LOSS_TYPES
        ):
            warnings.warn(
                f"importance_sampling_level='sequence' with loss_type={self.loss_type!r} sums "
                "tokens, so it weights sequences by their length (TRL #3823, #6042); use "
                "loss_type='grpo' for GSPO's per-sequence objective or 'seq_mean_token_sum' "
                "for Fast-LLM's",
                UserWarning,
                stacklevel=3,
            )

    @property
    def needs_old_logprobs(self) -> bool:
        """Old log-probs are computed after generation iff g % (S·μ) != 0 (as TRL).

        Otherwise each generation buffer is used up (all its S·μ micro-steps) within one
        optimizer step, so the parameters that sampled it are the ones being trained and
        old = stop_gradient(current).
        """
        window = self.steps_per_generation * self.num_iterations
        return self.gradient_accumulation_steps % window != 0

    @property
    def resolved_reward_funcs(self) -> tuple[Callable[..., Any], ...] | None:
        """The callables ``reward_funcs`` names (loaded and checked at construction), or None."""
        return self._reward_callables

    @property
    def prompts_per_generation(self) -> int:
        """Unique prompts per generation batch, B_gen / G (the RepeatSampler batch size)."""
        return self.generation_batch_size // self.num_generations

    def replace(self, **changes: Any) -> GRPOConfig:
        """A copy with ``changes``, re-resolved from the batch fields the user gave.

        ``dataclasses.replace`` would pass both resolved ``generation_batch_size`` and
        ``steps_per_generation`` and trip rule 3; use this instead.
        """
        return GRPOConfig(**{**self.given_dict(), **changes})

    def given_dict(self) -> dict[str, Any]:
        """The constructor arguments (batch fields as given), for dumps that reload."""
        kwargs = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        kwargs["generation_batch_size"], kwargs["steps_per_generation"] = self._given
        return kwargs
