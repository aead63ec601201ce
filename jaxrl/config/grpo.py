"""``GRPOConfig``: TRL's GRPO fields and defaults, resolved and validated at construction.

Field names, defaults and the resolution order follow huggingface/trl after PR #3388/#3725.
``generation_batch_size`` and ``steps_per_generation`` are plain fields: construction takes the
values given, resolves B_gen and S from them (``resolve_generation_batch``, TRL's rule 3) and
stores the resolved values in the two fields, as TRL's ``__post_init__`` does, remembering which
were given (``given``). ``GRPOConfig.replace`` rebuilds from the values given, so a changed
batch or world size resolves anew (``dataclasses.replace`` would pass both resolved values back,
which rule 3 refuses). ``world_size`` is the run's
(``RunConfig`` sets it from the mesh); in a config file it is an error. The accepted loss types,
importance-sampling levels, reward scalings and aggregations are the lists the loss code itself
checks (``jaxrl.losses.loss_types``, ``jaxrl.losses.advantages``), imported, not copied.

``reward_funcs`` holds the entries as written (names, mappings, ``"pkg.module:function"``,
``"file.py:function"``, or callables from Python), checked for their shape only: the trainer
imports and checks the functions (``jaxrl.rollout.rewards.specs``), so building a config runs no
user code (``jaxrl.config.reward_entries``).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from jaxrl.config.base import (
    STAGE_SCHEDULE_FIXES,
    WORLD_SIZE_FROM_MESH,
    ConfigError,
    removed_fields,
    require,
    require_choice,
)
from jaxrl.config.reward_entries import check_reward_specs
from jaxrl.losses.advantages import (
    AGGREGATIONS,
    ESTIMATORS,
    SCALE_REWARDS,
    resolve_scale_rewards,
)
from jaxrl.losses.loss_types import (
    CORRECTION_MODES,
    GRPO_LOSS_TYPES,
    IMPORTANCE_SAMPLING_LEVELS,
    TOKEN_SUMMING_LOSS_TYPES,
)

EVAL_FIX = (
    "removed: jaxrl evaluates on data.eval (or the built-in task's eval problems) every "
    "logging.eval_every steps; delete the key"
)


TOOL_ISOLATION = ("thread", "subprocess")  # where grpo.tools run


def _check_spec(field: str, spec: Any, kind: str) -> None:
    ok = callable(spec) or (isinstance(spec, str) and (":" in spec or "." in spec))
    require(ok, field, spec, f"name the {kind} as 'pkg.module:name' or 'path/to/file.py:name'")


def _check_tools(c: GRPOConfig) -> None:
    """The shape of the tool fields (the trainer imports and checks the code they name)."""
    if c.tools is not None:
        ok = isinstance(c.tools, list | tuple) and not isinstance(c.tools, str)
        require(ok, "tools", c.tools, "give a list of tool functions")
        for i, spec in enumerate(c.tools):
            _check_spec(f"tools[{i}]", spec, "tool function")
    if c.environment is not None:
        _check_spec("environment", c.environment, "environment class")
    _positive_int("max_turns", c.max_turns)
    require_choice("tool_isolation", c.tool_isolation, TOOL_ISOLATION)
    require(
        isinstance(c.tool_parser, str) and bool(c.tool_parser),
        "tool_parser",
        c.tool_parser,
        "use 'hermes' or 'pkg.module:Parser'",
    )
    if c.tool_timeout is not None:
        require(c.tool_timeout > 0, "tool_timeout", c.tool_timeout, "use seconds > 0, or None")
    if c.tool_memory_limit_mb is not None:
        _positive_int("tool_memory_limit_mb", c.tool_memory_limit_mb)


def _positive_int(field: str, value: Any) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
    require(ok, field, value, "use an integer ≥ 1")


# TRL's vLLM keys: in jaxrl vLLM is a rollout backend, configured once for every algorithm that
# generates (rollout.backend, rollout.vllm.*; docs/rollout.md, "vLLM"), not a grpo option
_VLLM = "TRL's vLLM key; jaxrl: set rollout.backend: vllm"
_VLLM_ARG = (
    f"{_VLLM}, and pass the server option in rollout.vllm.extra_args (a server jaxrl starts) "
    "or to the servers you run (rollout.vllm.url)"
)
TRL_VLLM_FIXES = {
    "use_vllm": f"{_VLLM} (rollout.backend: engine, the default, is jaxrl's own sampler)",
    "vllm_mode": (
        f"{_VLLM}: servers jaxrl starts (rollout.vllm.command, else the installed vllm) or "
        "servers you run (rollout.vllm.url); there is no colocate mode"
    ),
    "vllm_server_base_url": f"{_VLLM} and rollout.vllm.url: http://host:port",
    "vllm_server_host": f"{_VLLM} and rollout.vllm.url: http://host:port",
    "vllm_server_port": f"{_VLLM} and rollout.vllm.url: http://host:port",
    "vllm_server_timeout": f"{_VLLM}; rollout.vllm.start_timeout is the seconds to start",
    "vllm_group_port": f"{_VLLM}; rollout.vllm.weight_transfer picks disk, nccl or ipc",
    "vllm_gpu_memory_utilization": _VLLM_ARG,
    "vllm_tensor_parallel_size": _VLLM_ARG,
    "vllm_max_model_length": _VLLM_ARG,
    "vllm_model_impl": _VLLM_ARG,
    "vllm_enable_sleep_mode": _VLLM_ARG,
    "vllm_guided_decoding_regex": f"{_VLLM}; guided decoding is not supported: delete the key",
    "vllm_structured_outputs_regex": f"{_VLLM}; structured outputs are not supported: delete it",
    "vllm_importance_sampling_correction": (
        "TRL's vLLM key; jaxrl: grpo.importance_sampling_correction (any rollout.backend)"
    ),
    "vllm_importance_sampling_mode": (
        "TRL's vLLM key; jaxrl: grpo.importance_sampling_correction (any rollout.backend)"
    ),
    "vllm_importance_sampling_cap": (
        "TRL's vLLM key; jaxrl: grpo.importance_sampling_cap (any rollout.backend)"
    ),
}

ROUTER_REPLAY = ("none", "rollout")  # grpo.router_replay (jaxrl/models/moe, docs/moe.md)


@removed_fields(
    do_eval=EVAL_FIX,
    eval_strategy=EVAL_FIX,
    per_device_eval_batch_size=EVAL_FIX,
    num_generations_eval="removed: logging.eval_samples sets the samples per held-out prompt",
    auto_find_batch_size=(
        "removed: jaxrl never shrinks the batch (it would break prompt groups, TRL PR #6411); "
        "delete the key, and on OOM lower schedule.max_tokens"
    ),
    docs_per_step="removed: set schedule.docs_per_step instead (one setting for every trainer)",
    fp32_lm_head="removed: set model.fp32_lm_head instead (one setting for every trainer)",
    max_tool_calling_iterations=(
        "TRL's name; jaxrl counts assistant turns: set max_turns to TRL's value + 1"
    ),
    **TRL_VLLM_FIXES,
    **STAGE_SCHEDULE_FIXES,
)
@dataclasses.dataclass(frozen=True, kw_only=True)
class GRPOConfig:
    """GRPO / GSPO / DAPO / Dr.GRPO algorithm settings (TRL names)."""

    RUN_FIELDS: ClassVar[Mapping[str, str]] = WORLD_SIZE_FROM_MESH  # not config-file keys

    per_device_train_batch_size: int = 8  # b: completions per rank per micro-step
    gradient_accumulation_steps: int = 1  # g: micro-steps per optimizer step
    world_size: int | None = 1  # P: data-parallel size; in a RunConfig its mesh's data × fsdp,
    # None until the run knows it (a mesh axis of -1)
    num_generations: int = 8  # G: completions per prompt, ≥ 2
    generation_batch_size: int | None = None  # B_gen: completions per generation, all ranks;
    # give it or steps_per_generation (not both); holds the resolved value after construction
    # (None until P is known)
    steps_per_generation: int | None = None  # S: micro-steps served by one generation buffer;
    # None = g; holds the resolved value after construction
    num_iterations: int = 1  # μ: passes over each generation buffer
    shuffle_dataset: bool = True  # permute the prompt order each epoch
    max_completion_length: int = 512  # generation cap; also Dr.GRPO's constant
    max_prompt_length: int | None = 512  # longer prompts keep their last tokens; None = no cap
    temperature: float = 1.0  # sampling temperature; training logits are divided by it too
    top_k: int | None = None  # sample from the k most likely tokens; None or 0 = off
    top_p: float = 1.0  # nucleus sampling mass in (0, 1]; 1 = off
    epsilon: float = 0.2  # ε_low: lower clip width
    epsilon_high: float | None = None  # ε_high: upper clip width; None → epsilon; with cispo
    # the cap on the importance weight itself (required; ScaleRL: 5.0)
    delta: float | None = None  # cap on the unclipped ratio (two-sided clipping), > 1
    beta: float = 0.0  # KL coefficient; 0 → no reference model
    use_bias_correction_kl: bool = False  # multiply each token's k3 by the differentiable
    # ratio ρ (TRL's option, on by default in TRL 1.16); docs/algorithms/grpo.md §4
    loss_type: str = "dapo"  # grpo, bnpo, dr_grpo, dapo, seq_mean_token_sum, cispo
    importance_sampling_level: str = "token"  # token, or sequence (GSPO)
    importance_sampling_correction: str | None = None  # weight the loss by π_old/π_sampler:
    # token_truncate, token_mask, sequence_truncate, sequence_mask, sequence_geo_mask; None =
    # off (TRL: vllm_importance_sampling_mode, on by default there); docs/algorithms/grpo.md §7
    importance_sampling_cap: float = 3.0  # C: truncate the weight at C or mask outside [1/C, C]
    router_replay: str = "none"  # MoE models: none, or rollout = the training and scoring
    # forwards use the sampler's recorded expert ids (R3; docs/moe.md)
    scale_rewards: str | bool = "group"  # group, batch, none; True → group, False → none
    advantage_estimator: str = "grpo"  # grpo; rloo (leave-one-out); reinforce_pp (batch-
    # normalised REINFORCE++): docs/algorithms/grpo.md §6
    kl_in_reward: bool = False  # reinforce_pp: β·KL per token goes into the reward (per-token
    # returns, whitened over the batch's tokens) instead of the loss; needs beta > 0
    reward_funcs: tuple[str | dict[str, Any] | Callable[..., Any], ...] | None = None  # None →
    # the trainer's default; built-in names, {name: ..., params}, "pkg.mod:fn", "file.py:fn"
    # (the trainer loads them: docs/rewards.md)
    reward_weights: tuple[float, ...] | None = None  # one weight per reward function; None → 1
    reward_timeout: float | None = 300.0  # seconds one reward function call may take; then the
    # run stops naming the function and rows (a hung call cannot be stopped); None = no limit
    multi_objective_aggregation: str = "sum_then_normalize"  # or normalize_then_sum
    mask_truncated_completions: bool = False  # completions without EOS get no loss
    dynamic_sampling: bool = False  # DAPO: drop prompt groups whose rewards all agree and keep
    # generating until the generation batch is full of groups with a learning signal
    max_dynamic_sampling_rounds: int = 8  # generations one batch may take before the run stops
    zero_spread_steps: int = 5  # N: after N steps in a row whose groups all had equal rewards
    # (no policy gradient) the run warns once, naming the likely causes; 0 = never
    stop_on_zero_spread: bool = False  # end the run there instead (its own message and
    # summary key stopped_zero_spread), not spend its remaining steps on no gradient
    top_entropy_quantile: float = 1.0  # q: keep the top-q entropy tokens in the policy loss
    tools: tuple[str | Callable[..., Any], ...] | None = None  # tool functions the policy may call
    # ("pkg.mod:fn", "file.py:fn"): multi-turn episodes (docs/tools.md); None = single turn
    environment: str | type | None = None  # a class ("pkg.mod:Cls", "file.py:Cls"): one per
    # episode, reset(**row), public methods are tools (TRL's environment_factory)
    max_turns: int = 4  # assistant turns per episode with tools; max_completion_length is the
    # episode's token budget (model and environment tokens together)
    tool_parser: str = "hermes"  # how tool calls are written: hermes (<tool_call>{json}
    # </tool_call>, Qwen2.5), or "pkg.mod:Parser" / "file.py:Parser" with parse(text)
    tool_timeout: float | None = 10.0  # seconds a tool call may take before the model is told
    # it timed out; None = no limit
    tool_isolation: str = "thread"  # thread: tools run in this process; subprocess: in a
    # worker process (killed at the timeout, memory-limited); environment methods run here
    tool_memory_limit_mb: int | None = 1024  # address-space limit of the subprocess worker
    shared_prompt_packing: bool = False  # train each prompt once per row: its completions
    # (same prompt, same generation) attend to one copy of it instead of G copies; the same
    # update, fewer trained tokens (docs/algorithms/grpo.md §12); GRPO only, not PPO

    def __post_init__(self) -> None:
        """Validation, then the one resolution step: B_gen and S from the values given
        (``resolve_generation_batch``) stored in their fields, the given ones kept (``given``)."""
        _positive_int("per_device_train_batch_size", self.per_device_train_batch_size)
        if self.world_size is not None:
            _positive_int("world_size", self.world_size)
        _positive_int("gradient_accumulation_steps", self.gradient_accumulation_steps)
        given = {name: getattr(self, name) for name in RESOLVED_FIELDS}
        generation = resolve_generation_batch(self)
        object.__setattr__(self, "_given", given)
        object.__setattr__(self, "generation_batch_size", generation.size)
        object.__setattr__(self, "steps_per_generation", generation.steps)
        self._check_groups(generation.size)
        self._check_choices()
        self._check_ranges()
        self._check_loss()
        _check_tools(self)
        self._check_rewards()
        self._warn_sequence_level()

    def _check_groups(self, b_gen: int | None) -> None:
        """Rules 5 and 6: a generation holds whole prompt groups of at least 2 completions."""
        g_count = self.num_generations
        if b_gen is not None and isinstance(g_count, int) and g_count >= 1:
            require(
                b_gen % g_count == 0,
                "generation_batch_size",
                b_gen,
                f"it must be divisible by num_generations={g_count} so that a generation holds "
                "whole prompt groups; change generation_batch_size (or b, world_size, "
                "steps_per_generation) or num_generations",
            )
        require(
            isinstance(g_count, int) and not isinstance(g_count, bool) and g_count >= 2,
            "num_generations",
            g_count,
            "GRPO needs at least 2 generations per prompt; set num_generations ≥ 2",
        )

    def _check_choices(self) -> None:
        """Rule 7: the enumerations, and the options that belong to one estimator."""
        require_choice("loss_type", self.loss_type, GRPO_LOSS_TYPES)
        require_choice(
            "importance_sampling_level", self.importance_sampling_level, IMPORTANCE_SAMPLING_LEVELS
        )
        require_choice("scale_rewards", self.scale_rewards, (*SCALE_REWARDS, True, False))
        require_choice(
            "multi_objective_aggregation", self.multi_objective_aggregation, AGGREGATIONS
        )
        require_choice("advantage_estimator", self.advantage_estimator, ESTIMATORS)
        require_choice("router_replay", self.router_replay, ROUTER_REPLAY)
        if self.importance_sampling_correction is not None:
            require_choice(
                "importance_sampling_correction",
                self.importance_sampling_correction,
                CORRECTION_MODES,
            )
        if self.advantage_estimator != "grpo":
            require(
                resolve_scale_rewards(self.scale_rewards) == "group",
                "scale_rewards",
                self.scale_rewards,
                f"it is GRPO's normalisation; advantage_estimator={self.advantage_estimator!r} "
                "scales its own way: remove scale_rewards",
            )
            require(
                self.multi_objective_aggregation == "sum_then_normalize",
                "multi_objective_aggregation",
                self.multi_objective_aggregation,
                f"normalize_then_sum is GRPO's; with advantage_estimator="
                f"{self.advantage_estimator!r} use sum_then_normalize",
            )
        if self.use_bias_correction_kl:
            require(
                not self.kl_in_reward,
                "use_bias_correction_kl",
                self.use_bias_correction_kl,
                "it weights the KL term of the loss, and kl_in_reward puts the KL in the reward: "
                "set one of them to false",
            )
        if self.kl_in_reward:
            require(
                self.advantage_estimator == "reinforce_pp",
                "kl_in_reward",
                self.kl_in_reward,
                "it is REINFORCE++'s option: set advantage_estimator=reinforce_pp (or put the KL "
                "in the loss with beta alone)",
            )
            require(
                self.beta > 0,
                "kl_in_reward",
                self.kl_in_reward,
                "the KL coefficient is beta: set beta > 0 (e.g. 0.01)",
            )

    def _check_ranges(self) -> None:
        """Rule 7: counts, probabilities, widths and the stage's schedule."""
        _positive_int("max_dynamic_sampling_rounds", self.max_dynamic_sampling_rounds)
        require(
            self.zero_spread_steps >= 0,
            "zero_spread_steps",
            self.zero_spread_steps,
            "use 0 (never warn) or a positive number of consecutive steps",
        )
        require(
            not self.stop_on_zero_spread or self.zero_spread_steps > 0,
            "stop_on_zero_spread",
            self.stop_on_zero_spread,
            "set grpo.zero_spread_steps to the number of steps without signal that ends the run",
        )
        require(
            self.importance_sampling_cap > 1,
            "importance_sampling_cap",
            self.importance_sampling_cap,
            "use a value > 1 (TRL's default is 3.0)",
        )
        if self.max_prompt_length is not None:
            _positive_int("max_prompt_length", self.max_prompt_length)
        for name in ("num_iterations", "max_completion_length"):
            _positive_int(name, getattr(self, name))
        require(self.temperature > 0, "temperature", self.temperature, "use a value > 0")
        if self.top_k is not None:
            ok = isinstance(self.top_k, int) and not isinstance(self.top_k, bool)
            require(ok and self.top_k >= 0, "top_k", self.top_k, "use an integer ≥ 0 (0 = off)")
        require(0 < self.top_p <= 1, "top_p", self.top_p, "use a value in (0, 1]; 1 disables it")
        for name in ("epsilon", "epsilon_high", "beta"):
            value = getattr(self, name)
            if value is not None:
                require(value >= 0, name, value, "use a value ≥ 0")
        q = self.top_entropy_quantile
        require(0 < q <= 1, "top_entropy_quantile", q, "use a value in (0, 1]; 1 disables it")
        if self.delta is not None:
            require(self.delta > 1, "delta", self.delta, "use a value > 1, or None to disable")

    def _check_loss(self) -> None:
        """CISPO caps the importance weight with epsilon_high and has no delta."""
        if self.loss_type != "cispo":
            return
        require(
            self.epsilon_high is not None and self.epsilon_high > 0,
            "epsilon_high",
            self.epsilon_high,
            "loss_type='cispo' caps the importance weight at epsilon_high (not a clip width): "
            "set it, e.g. 5.0 (ScaleRL)",
        )
        require(
            self.delta is None,
            "delta",
            self.delta,
            "loss_type='cispo' caps the weight with epsilon_high; remove delta",
        )

    def _check_rewards(self) -> None:
        """The reward entries' shape, one weight per function, a positive deadline."""
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
            check_reward_specs(self.reward_funcs)
            weights, count = self.reward_weights, len(self.reward_funcs)
            if weights is not None and len(weights) != count:
                raise ConfigError(
                    f"reward_weights={list(weights)} has {len(weights)} entries but "
                    f"reward_funcs has {count}: give one weight per reward function"
                )

    def _warn_sequence_level(self) -> None:
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
                stacklevel=4,
            )

    @property
    def generation(self) -> GenerationBatch:
        """B_gen and S as resolved at construction."""
        return GenerationBatch(self.generation_batch_size, self.steps_per_generation)

    @property
    def needs_old_logprobs(self) -> bool:
        """Old log-probs are computed after generation iff g % (S·μ) != 0 (as TRL).

        Otherwise each generation buffer is used up (all its S·μ micro-steps) within one
        optimizer step, so the parameters that sampled it are the ones being trained and
        old = stop_gradient(current).
        """
        window = self.generation.steps * self.num_iterations
        return self.gradient_accumulation_steps % window != 0

    @property
    def uses_tools(self) -> bool:
        """Episodes are multi-turn with tools (``tools`` or ``environment`` set)."""
        return bool(self.tools) or self.environment is not None

    @property
    def prompts_per_generation(self) -> int:
        """Unique prompts per generation batch, B_gen / G (the RepeatSampler batch size)."""
        size = self.generation.size
        if size is None:
            raise ValueError("prompts_per_generation needs the world size (for_world_size)")
        return size // self.num_generations

    def given(self, name: str) -> Any:
        """The value field ``name`` was given: for ``generation_batch_size`` and
        ``steps_per_generation`` what the user set (None when resolved from the other fields),
        for every other field its value."""
        if name in RESOLVED_FIELDS:
            return self.__dict__["_given"][name]
        return getattr(self, name)

    def replace(self, **changes: Any) -> GRPOConfig:
        """A new config with ``changes`` over the values given (B_gen and S resolve anew)."""
        given = {name: self.given(name) for name in RESOLVED_FIELDS if name not in changes}
        return dataclasses.replace(self, **given, **changes)

    def for_world_size(self, world_size: int) -> GRPOConfig:
        """This config resolved for ``world_size`` data-parallel ranks (a run's mesh); itself
        when it already is. Its warnings were given when it was built."""
        if world_size == self.world_size:
            return self
        with warnings.catch_warnings():  # the same warnings as at construction
            warnings.simplefilter("ignore", UserWarning)
            return self.replace(world_size=world_size)


# the fields construction resolves (TRL's rule 3); ``given`` keeps what the user set
RESOLVED_FIELDS = ("generation_batch_size", "steps_per_generation")


@dataclasses.dataclass(frozen=True)
class GenerationBatch:
    """A GRPOConfig's generation batch, resolved from the fields given (TRL's rule 3)."""

    size: int | None  # B_gen: completions per generation, all ranks; None until P is known
    steps: int | None  # S: micro-steps one generation buffer serves; None until P is known
    # when only generation_batch_size was given


def resolve_generation_batch(c: GRPOConfig) -> GenerationBatch:
    """B_gen and S from b, P, g and whichever of ``generation_batch_size`` /
    ``steps_per_generation`` was given (at most one; neither: S = g), read during construction
    before the two fields are resolved. ``ConfigError`` when
    both are given, or B_gen is not a multiple of the global batch b · P."""
    b_gen, steps = c.generation_batch_size, c.steps_per_generation  # as given (construction)
    if b_gen is not None and steps is not None:
        raise ConfigError(
            f"generation_batch_size={b_gen!r} and steps_per_generation={steps!r}: "
            "'generation_batch_size' and 'steps_per_generation' can not be both configured "
            "at the same time; set only one of them (to change a built GRPOConfig use its "
            "replace(), which keeps the values given, not dataclasses.replace)"
        )
    if b_gen is not None:
        _positive_int("generation_batch_size", b_gen)
    elif steps is not None:
        _positive_int("steps_per_generation", steps)
    else:
        steps = c.gradient_accumulation_steps
    if c.world_size is None:  # a run's section before its mesh is known
        return GenerationBatch(b_gen, steps)
    b_global = c.per_device_train_batch_size * c.world_size
    if b_gen is None:
        return GenerationBatch(b_global * steps, steps)
    require(
        b_gen % b_global == 0,
        "generation_batch_size",
        b_gen,
        f"it must be divisible by the global batch size per_device_train_batch_size "
        f"× world_size = {c.per_device_train_batch_size} × {c.world_size} = "
        f"{b_global}; use a multiple of {b_global}",
    )
    return GenerationBatch(b_gen, b_gen // b_global)
