"""A run's parts from its config: the built-in task, the model, the train state and the compiled
step, built one way for ``Session`` (which trains with them) and for ``jaxrl memory`` (which
plans them on abstract values).

:func:`model_config` is the one mapping from the config's ``model`` section to a
``ModelConfig``: ``model.path``'s config.json (``jaxrl.models.hf.read_config``) or
``model.init`` (``ModelConfig.tiny`` overrides), with the section's run settings (precision,
attention kernel, layer stack: ``MODEL_SECTION_KEYS``) in both cases.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

from jaxrl.config import ConfigError, RunConfig
from jaxrl.config.sections.model import MODEL_SECTION_KEYS, ModelSection
from jaxrl.data.tasks import ArithmeticTask
from jaxrl.data.tool_task import CalculatorTask
from jaxrl.models.adapters.peft import load_adapters, read_lora_spec
from jaxrl.models.attention.dispatch import resolve_attention_impl
from jaxrl.models.hf import load_pretrained, read_config
from jaxrl.models.lora import dense_config, frozen_copy, quantize_base, split_adapters
from jaxrl.models.model_config import LoraSpec, ModelConfig
from jaxrl.models.sharding import state_shardings
from jaxrl.models.transformer import Transformer
from jaxrl.runtime.mesh import mesh_from_config
from jaxrl.train.objectives import Objective, load_balance_constants, on_params
from jaxrl.train.optimizer import learning_rate_schedule, make_optimizer
from jaxrl.train.precision import auto_compute_dtype, auto_matmul_dtype
from jaxrl.train.state import TrainState, abstract_state, create_state
from jaxrl.train.step import TrainStep

__all__ = ["RunParts", "build_model", "build_run", "build_task", "exact_base", "model_config"]


def build_task(cfg: RunConfig) -> ArithmeticTask | CalculatorTask:
    """The built-in task the ``task`` section describes, seeded by the run."""
    t = cfg.task
    if t is None:
        raise ConfigError(
            f"data.train={cfg.data.train!r} is set, so there is no built-in task to build "
            "(internal: a trainer asked for the task on real data)"
        )
    if t.name == "calculator":
        return CalculatorTask(
            min_digits=t.min_digits,
            max_digits=t.max_digits,
            ops=t.ops,
            seed=cfg.seed,
            tool_transcripts=t.tool_transcripts,
        )
    return ArithmeticTask(
        min_digits=t.min_digits,
        max_digits=t.max_digits,
        ops=t.ops,
        reverse_answer=t.reverse_answer,
        pad_operands=t.pad_operands,
        seed=cfg.seed,
    )


def model_config(
    section: ModelSection, vocab_size: int | None, platform: str | None = None
) -> ModelConfig:
    """The ``ModelConfig`` the ``model`` section describes; no weight is read. ``model.dtype:
    auto`` resolves for ``platform`` (default: this backend; ``precision.auto_compute_dtype``).

    ``vocab_size``: the tokenizer's, when known. ``model.init`` takes it as the vocabulary
    unless ``model.init.vocab_size`` names a larger one (padded, as HF models are); a model
    smaller than the tokenizer is refused (``ConfigError``), since ids past its vocabulary would
    be clamped silently. ``model.path`` errors are those of ``read_config``; with it,
    ``model.init.router_aux_loss_coef`` (the MoE load-balance loss, docs/moe.md) still applies.
    """
    settings = {name: getattr(section, name) for name in MODEL_SECTION_KEYS}
    settings["dtype"] = auto_compute_dtype(section.dtype, platform)
    settings["matmul_dtype"] = auto_matmul_dtype(section.matmul_dtype, section.dtype, platform)
    settings["lora"] = lora_spec(section)
    if section.path is not None:
        config = read_config(section.path, **settings)
        if "router_aux_loss_coef" in section.init:  # a training setting over config.json's
            coef = float(section.init["router_aux_loss_coef"])
            config = dataclasses.replace(config, router_aux_loss_coef=coef)
        if vocab_size is not None and vocab_size > config.vocab_size:
            raise ConfigError(
                f"the tokenizer has {vocab_size} tokens but the model at model.path="
                f"{section.path} has a vocabulary of {config.vocab_size}: ids past it would be "
                "clamped silently; use the model's own tokenizer"
            )
        return config
    init = dict(section.init)
    vocab = init.pop("vocab_size", vocab_size)
    if vocab is None:
        raise ConfigError(
            "model.init.vocab_size is missing and there is no tokenizer to take it from; set it"
        )
    if vocab_size is not None and int(vocab) < vocab_size:
        raise ConfigError(
            f"model.init.vocab_size={vocab} is invalid: the tokenizer has {vocab_size} tokens; "
            f"use at least {vocab_size} (or leave it out to take the tokenizer's size)"
        )
    return ModelConfig.tiny(int(vocab), **init, **settings)


def lora_spec(section: ModelSection) -> LoraSpec | None:
    """The ``LoraSpec`` of ``model.lora``: its own fields, or those of ``adapter_path``'s
    adapter_config.json (a PEFT directory) when given; None without adapters."""
    lora = section.lora
    if lora.adapter_path is None:
        return lora.spec()
    try:
        return read_lora_spec(lora.adapter_path, quantize=lora.quantize)
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"model.lora.adapter_path={lora.adapter_path!r} is invalid: {e}; name a directory "
            "written by PEFT's save_pretrained (or by a jaxrl LoRA run: <output_dir>/adapter)"
        ) from None


def fresh_model(config: ModelConfig, seed: int) -> tuple[Any, Callable[[], Any]]:
    """``(graphdef, init)``: a new model's graph (traced, never allocated) and the function that
    initialises its parameters (run under ``jit`` into their shardings by ``create_state``)."""

    def init() -> Any:
        return nnx.split(Transformer(config, rngs=nnx.Rngs(params=seed)))[1]

    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
    return graphdef, init


def build_model(cfg: RunConfig, vocab_size: int, mesh: Mesh | None = None) -> tuple[Any, Any, Any]:
    """``(graphdef, params, config)``: a local HF checkpoint (``model.path``), each tensor placed
    on its shards, or a fresh model whose ``params`` is a function that initialises it (run under
    ``jit`` into its shardings by ``create_state``)."""
    try:
        resolve_attention_impl(cfg.model.attention_impl)  # a kernel the backend lacks fails here
    except ValueError as e:
        raise ConfigError(str(e)) from e
    config = model_config(cfg.model, vocab_size)
    # a LoRA run reads (or initialises) the plain model; adapters and quantisation come after
    # (lora_parts)
    if cfg.model.path is None:
        graphdef, params = fresh_model(dense_config(config), cfg.seed)
    else:
        graphdef, params = nnx.split(
            load_pretrained(cfg.model.path, dense_config(config), mesh=mesh)
        )
    if config.lora is not None:
        graphdef = fresh_model(config, cfg.seed)[0]
    return graphdef, params, config


@dataclasses.dataclass(frozen=True)
class RunParts:
    """What a run trains with: its mesh, model, state (in its shardings) and compiled step."""

    mesh: Mesh
    model_config: ModelConfig
    graphdef: Any
    state: TrainState  # ShapeDtypeStructs when built ``abstract``
    shardings: TrainState  # the state's NamedShardings
    step: TrainStep
    frozen: Any = None  # LoRA: the frozen base (compute dtype / quantised); state holds adapters
    frozen_shardings: Any = None


def build_run(
    cfg: RunConfig,
    vocab_size: int | None,
    objective: Objective | None,
    *,
    abstract: bool = False,
    mesh: Mesh | None = None,
) -> RunParts:
    """The mesh (``mesh_from_config``), model, train state and compiled step of ``cfg``,
    minimising ``objective`` (``jaxrl.train.objectives``; None for a run that is never stepped,
    e.g. one that only exports).

    ``abstract``: shapes only, for planning (``jaxrl memory``): nothing is allocated, a
    ``model.path`` contributes its config.json alone, and the attention kernel is not checked
    against this backend. ``vocab_size``: the tokenizer's (None: not known, planning only).
    ``mesh``: the mesh to build on (default ``mesh_from_config``; a target compile's is made
    of the target's compile-only devices).
    """
    mesh = mesh_from_config(cfg.mesh) if mesh is None else mesh
    tx = make_optimizer(cfg.optimizer, cfg.max_steps)
    frozen = frozen_shardings = None
    if abstract:
        config = model_config(cfg.model, vocab_size)
        graphdef, params = fresh_model(dense_config(config), cfg.seed)
        if config.lora is not None:
            graphdef = fresh_model(config, cfg.seed)[0]
            params, frozen, frozen_shardings = lora_parts(config, params, cfg, mesh, abstract=True)
        state, shardings = abstract_state(params, tx, cfg.seed, mesh)
    else:
        graphdef, params, config = build_model(cfg, vocab_size, mesh)
        if config.lora is not None:
            params, frozen, frozen_shardings = lora_parts(config, params, cfg, mesh)
        state, shardings = create_state(params, tx, cfg.seed, mesh)
        if cfg.model.lora.adapter_path is not None:
            path = cfg.model.lora.adapter_path
            adapters = load_adapters(path, config, state.params, shardings.params)
            state = state.replace(params=adapters)
    step = TrainStep(
        on_params(objective, graphdef),
        tx,
        mesh,
        learning_rate=learning_rate_schedule(cfg.optimizer, cfg.max_steps),
        max_grad_norm=cfg.optimizer.max_grad_norm,
        docs_per_step=cfg.schedule.docs_per_step,
        state_shardings=shardings,
        master_rounding=cfg.optimizer.master_rounding,
        frozen=frozen,
        frozen_shardings=frozen_shardings,
        step_constants=load_balance_constants(config),  # MoE aux loss on: a pre-pass
    )
    return RunParts(mesh, config, graphdef, state, shardings, step, frozen, frozen_shardings)


def exact_base(cfg: RunConfig, vocab_size: int, mesh: Mesh) -> Any:
    """A LoRA run's frozen base in its original precision: ``model.path``'s weights as read (or
    the fresh initialisation) in ``model.param_dtype``, quantised as the run's base is, never
    the compute-dtype copy the steps use. What the merged export adds the adapters to (read
    again at export time: the run holds only the compute copy)."""
    _, params, config = build_model(cfg, vocab_size, mesh)
    exact = dataclasses.replace(config, dtype=config.param_dtype)
    return lora_parts(exact, params, cfg, mesh)[1]


def lora_parts(
    config: ModelConfig, base: Any, cfg: RunConfig, mesh: Mesh, *, abstract: bool = False
) -> tuple[Callable[[], Any], Any, Any]:
    """``(init_adapters, frozen, frozen_shardings)`` of a LoRA run (docs/lora.md).

    ``base``: the plain model's parameters (loaded state, or the function that initialises
    them). ``init_adapters`` makes fresh adapters (PEFT init; under ``create_state``'s jit);
    ``frozen`` is the base quantised per ``model.lora.quantize`` and cast to the compute dtype,
    built under ``jit`` straight into its shardings (ShapeDtypeStructs when ``abstract``).
    """
    dense_graphdef = fresh_model(dense_config(config), cfg.seed)[0]

    def init_adapters() -> Any:
        return split_adapters(Transformer(config, rngs=nnx.Rngs(params=cfg.seed)))[0]

    def make_frozen(params: Any) -> Any:
        model = nnx.merge(dense_graphdef, params)
        quantize_base(model.layers, config)
        return frozen_copy(nnx.state(model), config.dtype)

    args = () if callable(base) else (base,)
    fn = (lambda: make_frozen(base())) if callable(base) else make_frozen
    shapes = jax.eval_shape(fn, *args)
    shardings = state_shardings(shapes, mesh)
    if abstract:
        return init_adapters, shapes, shardings
    return init_adapters, jax.jit(fn, out_shardings=shardings)(*args), shardings
