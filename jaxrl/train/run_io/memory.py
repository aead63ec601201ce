"""Will it fit? Per-device memory of a run, planned without allocating the model.

:func:`plan_memory` builds the run as training does (``jaxrl.train.build.build_run``: mesh,
model, train state, shardings under the package's rule table, compiled step) but *abstract*
(``nnx.eval_shape`` / ``jax.eval_shape``: shapes and dtypes, no buffers), and lowers and
compiles the real train step (``TrainStep``: the ``shard_map`` accumulation loop, clipping,
AdamW) on abstract inputs of the configured shapes.
Nothing the size of a parameter is ever allocated, so a 7B plan runs on a laptop; CPU host
devices stand in for the target's accelerators (``jaxrl memory`` asks XLA for as many as the
mesh needs).

Numbers are bytes on the largest device:

- LoRA (``model.lora``): ``params_bytes`` is the fp32 adapters plus the frozen base (compute
  dtype, or int8 / nf4 codes and their fp32 scales; ``uint4`` codes counted at half a byte),
  ``optimizer_bytes`` and ``grads_bytes`` cover the adapters only, GRPO keeps one compute copy
  (the merged sampler weights; the reference is the base itself), and ``lora`` gives the rank,
  the trained parameter count and the frozen base's bytes.
- ``params_bytes`` / ``optimizer_bytes``: the train state's master weights (``param_dtype``,
  fp32 unless a bf16 master is opted into; docs/precision.md) and AdamW state (two fp32
  moments + a step count), each under its sharding (``embed`` over
  ``fsdp``; heads, MLP units, vocabulary over ``tensor``; replicated over ``data``).
- ``grads_bytes``: one fp32 gradient per parameter in the parameters' sharding, the engine's
  accumulator (each round is reduce-scattered over ``fsdp`` into it, ``accumulate.py``).
- ``temp_bytes``: the compiled step's working memory (XLA ``memory_analysis``
  ``temp_size_in_bytes``, the peak of its temporaries) minus the accumulator: activations, the
  weights the ``shard_map`` gathers over ``fsdp`` at entry, each round's full-size gradients
  before their reduce-scatter, and the optimizer's temporaries. The last three scale with the
  whole model, not its shard, so ``fsdp`` divides the state but not this part. XLA counts the
  accumulator (a loop-carried buffer) among its temporaries, so it is taken out once here and
  shown as ``grads_bytes`` instead of being counted twice.
- ``compute_copy_bytes``: the compute-dtype (``model.dtype``) copies held between steps: GRPO's
  sampler copy and, with β > 0, its frozen reference (0 for SFT and DPO: the step casts each
  weight where it is used, inside its temporaries; DPO's reference is a cache of log-probs).
  A synchronous GRPO run (``rollout.max_staleness=0``) whose master weights are already in the
  compute dtype, with unrolled layers and no narrow matmul operands, holds no sampler copy: the
  sampler reads the trainer's arrays in place (the engine decodes unrolled, its projection
  kernels in ``model.matmul_dtype``: ``generate/sampler_weights.decode_model``).
- ``kv_cache_bytes``: GRPO's sampler KV caches (docs/rollout.md): the decode slots' cache
  ``[Nl, Sl, L, K, Dh]`` (keys and values; Sl = ``rollout.max_slots`` or one per completion of a
  generation batch, split over the batch ranks; L = the prompt bucket of
  ``grpo.max_prompt_length`` plus ``grpo.max_completion_length``, in decode-attention blocks)
  plus the prompt groups' prefill cache ``[Nl, Q, P, K, Dh]`` (replicated), plus, with
  ``rollout.compact_slots``, the slots' cache at Sl/2 that the engine's first compaction
  gathers beside the full one (``Sampler.memory_bytes``). They live while a
  generation runs, which is not while the train step runs; they are counted on top anyway.
- ``total_bytes`` = params + optimizer + grads + compute copies + KV caches + temp: the peak on
  the device
  (the arguments stay live throughout, the temporaries peak on top). The batch (a few int32
  rows of ``max_tokens``) is left out, and so are the outputs: the state is donated, so the new
  state is written over the old one (``output_bytes`` / ``alias_bytes`` give XLA's view).

Every algorithm is planned with the SFT objective (``loss: "sft"``; ``jaxrl.train.objectives``):
GRPO and DPO run the same forward and backward through the same engine and only add a few
per-token / per-document fp32 fields. What the plan does not cover is reported in ``notes``
(e.g. the scorer's temporaries). The compiler's temporaries are the CPU
backend's: a GPU or TPU compile fuses and schedules differently, so treat ``temp_bytes`` as an
estimate and leave headroom.

Cost: the compile dominates. Unrolled (the default), it grows with the layer count, because the
layers are a Python loop in the step's HLO, forward and backward: a 28-layer 7B step compiles
in about 35 to 75 s on two CPU cores (4 layers: about 12 s). With ``model.scan_layers`` the
block is compiled once (a 28-layer 1.5B step: 4.6 s instead of 23 s), and with
``model.remat`` the plan shows the rematerialised step's temporaries. Per-device numbers
barely depend on the ``data`` size or on the number of micro-batch slots, so the abstract
batch has one slot per rank.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from jaxrl.config import STAGE_SECTIONS, ConfigError, RunConfig, SFTConfig
from jaxrl.data.batching.step_plan import DEVICE_FIELDS
from jaxrl.data.hub import local_model_dir
from jaxrl.generate.decode_layout import sampler_mesh, weight_bytes
from jaxrl.generate.sampler import Sampler
from jaxrl.generate.sampler_weights import reads_trainer_arrays
from jaxrl.models.lora import dense_config
from jaxrl.models.model_config import ModelConfig
from jaxrl.models.sharding import avals, bytes_per_device, state_shardings
from jaxrl.models.transformer import Transformer
from jaxrl.runtime.mesh import batch_ranks, batch_sharding, replicated
from jaxrl.train.build import RunParts, build_run, build_task
from jaxrl.train.objectives import sft_objective
from jaxrl.train.precision import AUTO, auto_compute_dtype

SEGMENT_SLOTS = 2  # documents per packed row in the abstract batch (shapes only)
_FLOAT_FIELDS = ("loss_mask",)
# The plan never runs the program, so LLVM need not optimise the machine code: level 0 leaves
# the HLO passes and the buffer assignment (all that memory_analysis reads) as they are (same
# bytes, checked on the 7B shape) and cuts the compile time by a fifth (7B) to a half (tiny).
_CPU_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}


def plan_run(cfg: RunConfig, mesh: Any = None) -> RunParts:
    """The run the trainers would build (``build_run``), on abstract values, with the SFT
    objective, ``model.dtype: auto`` read as an accelerator's (bfloat16). The vocabulary is
    ``model.path``'s config.json, else ``model.init.vocab_size``
    when given, else the built-in task's character tokenizer, as the trainers size it. A bad
    ``model`` section is a ``ConfigError`` naming it. ``mesh``: build on it (``build_run``)."""
    if cfg.model.path is not None:  # a hub id: its snapshot's config.json
        path = local_model_dir(cfg.model.path)
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=path))
    m = cfg.model
    if m.dtype == AUTO:  # a plan is for the accelerator the run targets, where auto is bf16
        m = dataclasses.replace(m, dtype=auto_compute_dtype(AUTO, "gpu"))
        cfg = dataclasses.replace(cfg, model=m)
    vocab_size = None
    if m.path is None and "vocab_size" not in m.init:
        vocab_size = build_task(cfg).tokenizer().vocab_size
    sft = cfg.sft if cfg.sft is not None else SFTConfig()  # the plan's stand-in objective
    objective = sft_objective(sft, chunk_size=cfg.model.logprob_chunk)
    try:
        return build_run(cfg, vocab_size, objective, abstract=True, mesh=mesh)
    except ConfigError:
        raise
    except (ValueError, TypeError, KeyError, FileNotFoundError) as e:
        where = f"model.path={m.path!r}" if m.path is not None else "model.init"
        raise ConfigError(f"{where}: {e}") from e


def abstract_batch(mesh: Any, max_tokens: int, slots: int = 1) -> dict[str, jax.ShapeDtypeStruct]:
    """The train step's batch ``[R, M, T]`` (``doc_sample_index``: ``[R, M, S]``) as abstract
    arrays split over the batch axes, with the dtypes the step planner produces."""
    ranks, sharding = batch_ranks(mesh), batch_sharding(mesh)
    batch = {}
    for name in DEVICE_FIELDS:
        width = SEGMENT_SLOTS if name == "doc_sample_index" else max_tokens
        dtype = jnp.float32 if name in _FLOAT_FIELDS else jnp.int32
        batch[name] = jax.ShapeDtypeStruct((ranks, slots, width), dtype, sharding=sharding)
    return batch


def plan_memory(cfg: RunConfig) -> dict[str, Any]:
    """Per-device memory of ``cfg``'s train step (bytes on the largest device), computed on
    abstract values: no parameter, moment or batch is ever allocated.

    Returns a JSON-ready dict: ``params_bytes``, ``optimizer_bytes``, ``grads_bytes``,
    ``temp_bytes`` and ``total_bytes`` (their sum; see the module docstring), ``devices``,
    ``mesh``, ``batch_ranks``, ``max_tokens``, ``model`` (its shape), ``num_params``,
    ``unsharded_params_bytes`` (the whole model in ``param_dtype``), XLA's own
    ``compiled_temp_bytes`` / ``argument_bytes`` / ``output_bytes`` / ``alias_bytes``, the
    lowering and compile times and ``notes``. Raises ``ConfigError`` when the mesh does not
    match the devices (the rule training applies) or the model section is invalid.
    """
    run = plan_run(cfg)
    mesh, config, state, shardings = run.mesh, run.model_config, run.state, run.shardings
    params_bytes = bytes_per_device(state.params, shardings.params)
    frozen_bytes = 0
    if run.frozen is not None:  # LoRA: the trained adapters are state.params; add the base
        frozen_bytes = _packed_bytes(run.frozen, run.frozen_shardings)
    optimizer_bytes = bytes_per_device(state.opt_state, shardings.opt_state)
    grads32 = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float32), state.params)
    grads_bytes = bytes_per_device(grads32, shardings.params)
    leaves = jax.tree.leaves(state.params)
    num_params = sum(math.prod(p.shape) for p in leaves)
    unsharded = sum(math.prod(p.shape) * np.dtype(p.dtype).itemsize for p in leaves)

    compute_dtype = jnp.dtype(config.dtype)  # ModelConfig resolves None to param_dtype
    dense, dense_shardings = state.params, shardings.params
    if run.frozen is not None:  # the sampler's copy is the merged dense model
        dense = nnx.state(
            nnx.eval_shape(lambda: Transformer(dense_config(config), rngs=nnx.Rngs(0)))
        )
        dense_shardings = state_shardings(dense, mesh)
    compute_shapes = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, compute_dtype), dense)
    # GRPO's sampler decodes in its own layout (jaxrl.generate.decode_layout); its reference
    # (β > 0) is scored in the trainer's
    decode, decode_mesh = _decode_plan(cfg, config, mesh)
    copies = sampler_copy = reference_copy = 0
    if decode is not None:
        in_place = (  # the sampler reads the trainer's arrays (generate/sampler_weights.py)
            run.frozen is None
            and cfg.rollout.max_staleness == 0
            and decode_mesh is mesh
            and reads_trainer_arrays(config, scan_layers=cfg.rollout.scan_layers)
        )
        if not in_place:
            sampler_copy = decode["device_weight_bytes"]
        # LoRA: the reference is the frozen base itself (adapters disabled)
        if cfg.stage.beta != 0.0 and run.frozen is None:
            reference_copy = bytes_per_device(compute_shapes, dense_shardings)
        copies = int(sampler_copy > 0) + int(reference_copy > 0)
    compute_copy_bytes = sampler_copy + reference_copy
    # PPO's critic: a second Transformer (plus a d → 1 value head) trained by its own AdamW in
    # the policy's layout: once more the policy's master weights, moments and gradients
    critic_bytes = params_bytes + optimizer_bytes + grads_bytes if cfg.trains_critic else 0
    params_bytes += frozen_bytes
    kv_cache_bytes = 0 if decode is None else decode["kv_cache_bytes"]

    analysis, lower_s, compile_s = _compile_step(cfg, run)
    compiled_temp = int(analysis.temp_size_in_bytes)
    temp_bytes = max(compiled_temp - grads_bytes, 0)  # the accumulator is one of XLA's temps
    platform = mesh.devices.flat[0].platform
    return {
        "algorithm": cfg.algorithm,
        "loss": "sft",
        "devices": int(mesh.size),
        "platform": platform,
        "mesh": {axis: int(size) for axis, size in mesh.shape.items()},
        "batch_ranks": batch_ranks(mesh),
        "max_tokens": cfg.schedule.max_tokens,
        "model": {name: getattr(config, name) for name in _MODEL_FIELDS},
        "num_params": int(num_params),
        "unsharded_params_bytes": int(unsharded),
        "params_bytes": int(params_bytes),
        "lora": _lora_fields(config, state.params, frozen_bytes),
        "optimizer_bytes": int(optimizer_bytes),
        "grads_bytes": int(grads_bytes),
        "compute_copy_bytes": int(compute_copy_bytes),
        "compute_copies": copies,
        "decode": decode,
        "kv_cache_bytes": int(kv_cache_bytes),
        "critic_bytes": int(critic_bytes),
        "temp_bytes": int(temp_bytes),
        "total_bytes": int(
            params_bytes
            + optimizer_bytes
            + grads_bytes
            + critic_bytes
            + compute_copy_bytes
            + kv_cache_bytes
            + temp_bytes
        ),
        "compiled_temp_bytes": compiled_temp,
        "argument_bytes": int(analysis.argument_size_in_bytes),
        "output_bytes": int(analysis.output_size_in_bytes),
        "alias_bytes": int(analysis.alias_size_in_bytes),
        "lower_s": round(lower_s, 2),
        "compile_s": round(compile_s, 2),
        "notes": _notes(cfg, platform),
    }


def _packed_bytes(tree: Any, shardings: Any) -> int:
    """``bytes_per_device``, with 4-bit codes (``uint4``, nf4) counted at half a byte each, as
    accelerators store them packed."""
    full = bytes_per_device(tree, shardings)
    four_bit = [
        (x, s)
        for x, s in zip(
            jax.tree.leaves(tree),
            jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, NamedSharding)),
            strict=True,
        )
        if jnp.dtype(x.dtype) in (jnp.dtype(jnp.uint4), jnp.dtype(jnp.int4))
    ]
    if not four_bit:
        return full
    halves = bytes_per_device([x for x, _ in four_bit], [s for _, s in four_bit]) // 2
    return full - halves


def _lora_fields(config: Any, adapters: Any, frozen_bytes: int) -> dict[str, Any] | None:
    """LoRA runs: rank, quantisation, trained parameter count, adapter and frozen-base bytes."""
    if config.lora is None:
        return None
    return {
        "rank": config.lora.rank,
        "quantize": config.lora.quantize,
        "target_modules": list(config.lora.target_modules),
        "trainable_params": int(sum(math.prod(p.shape) for p in jax.tree.leaves(adapters))),
        "frozen_bytes": int(frozen_bytes),
    }


MIN_FIT_TOKENS = 512  # fit_budget tries micro-batch token budgets down to this one
STATE_KEYS = ("params_bytes", "optimizer_bytes", "grads_bytes", "critic_bytes")


def fit_budget(cfg: RunConfig, plan: dict[str, Any], budget: int) -> dict[str, Any]:
    """Whether ``plan`` (:func:`plan_memory` of ``cfg``) fits ``budget`` bytes per device and,
    when it does not, what would: the largest ``schedule.max_tokens`` (halving it down to
    ``MIN_FIT_TOKENS``, each planned by a compile) whose plan fits, else the ``mesh.fsdp`` that
    would divide the state enough (an estimate: the state scales with 1 / fsdp, the rest is
    kept at the smallest token budget's; plan it to check). Returns ``budget_bytes``, ``fits``
    and ``suggestion`` (None, ``{"schedule.max_tokens": n, "total_bytes": b}`` or
    ``{"mesh.fsdp": f, "estimated_total_bytes": b}``)."""
    out: dict[str, Any] = {"budget_bytes": budget, "fits": plan["total_bytes"] <= budget}
    out["suggestion"] = None
    if out["fits"]:
        return out
    tokens, smallest = cfg.schedule.max_tokens, plan
    while tokens // 2 >= MIN_FIT_TOKENS:
        tokens //= 2
        smaller = dataclasses.replace(
            cfg, schedule=dataclasses.replace(cfg.schedule, max_tokens=tokens)
        )
        smallest = plan_memory(smaller)
        if smallest["total_bytes"] <= budget:
            out["suggestion"] = {
                "schedule.max_tokens": tokens,
                "total_bytes": smallest["total_bytes"],
            }
            return out
    state = sum(smallest[k] for k in STATE_KEYS)
    rest = smallest["total_bytes"] - state
    if rest >= budget:  # more fsdp cannot help: activations, copies and caches alone overflow
        return out
    fsdp, factor = max(cfg.mesh.fsdp, 1), 1
    while rest + state / factor > budget:
        factor *= 2
    out["suggestion"] = {
        "mesh.fsdp": fsdp * factor,
        "estimated_total_bytes": int(rest + state / factor),
    }
    return out


def _decode_plan(cfg: RunConfig, config: ModelConfig, mesh: Any) -> tuple[Any, Any]:
    """``(decode, mesh)``: GRPO's sampler in its decode layout (``jaxrl.generate.decode_layout``)
    and that layout's mesh; ``decode`` reports the layout and what the sampler, asked through the
    rollout interface, holds on the largest device: its weights (``device_weight_bytes``; the
    whole model is ``weight_bytes``; a MoE model's experts split over the decode mesh's
    ``expert`` axis, ``expert_parallel``) and its KV caches for the configured generation batch.
    ``(None, None)`` for other algorithms."""
    if not cfg.samples_rollouts:  # PPO samples with GRPO's sampler
        return None, None
    r, g = cfg.rollout, cfg.stage.for_world_size(batch_ranks(mesh))
    dense = dense_config(config)
    dmesh = sampler_mesh(mesh, dense, r.tensor_parallel, r.weight_budget_gb)
    sampler = Sampler(  # abstract: nothing is allocated or compiled
        dense, max_new_tokens=g.max_completion_length, eos_id=0, pad_id=0, mesh=dmesh,
        max_slots=r.max_slots, scan_layers=r.scan_layers, compact_slots=r.compact_slots,
    )  # fmt: skip
    requests = g.generation.size
    prompt = g.max_prompt_length or max(cfg.schedule.max_tokens - g.max_completion_length, 1)
    decode = {
        "tensor_parallel": int(dmesh.shape["tensor"]),
        "expert_parallel": int(dmesh.shape.get("expert", 1)),  # MoE: the run's mesh.expert
        "mesh": {axis: int(size) for axis, size in dmesh.shape.items()},
        "weight_bytes": int(weight_bytes(dense)),
        "device_weight_bytes": int(sampler.weight_bytes()),
        "kv_cache_bytes": sampler.memory_bytes(
            requests, max(requests // g.num_generations, 1), prompt
        ),
    }
    return decode, dmesh


_MODEL_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "tie_word_embeddings",
    "param_dtype",
    "dtype",
)


def _compile_step(cfg: RunConfig, run: RunParts) -> tuple[Any, float, float]:
    """``(memory_analysis, lower_s, compile_s)`` of the run's train step, lowered on abstract
    state / batch / bounds in their shardings."""
    batch = abstract_batch(run.mesh, cfg.schedule.max_tokens)
    bounds = jax.ShapeDtypeStruct((2,), jnp.int32, sharding=replicated(run.mesh))
    started = time.perf_counter()
    frozen = None if run.frozen is None else avals(run.frozen, run.frozen_shardings)
    lowered = run.step._jitted.lower(avals(run.state, run.shardings), batch, bounds, frozen)
    lowered_at = time.perf_counter()
    cpu = run.mesh.devices.flat[0].platform == "cpu"
    compiled = lowered.compile(_CPU_COMPILER_OPTIONS if cpu else None)
    done = time.perf_counter()
    return compiled.memory_analysis(), lowered_at - started, done - lowered_at


def _notes(cfg: RunConfig, platform: str) -> list[str]:
    """What the numbers leave out, in words."""
    notes = []
    for axis, size in zip(("data", "fsdp", "tensor"), cfg.mesh.sizes, strict=True):
        if size == -1:
            notes.append(
                f"mesh.{axis}=-1 took the devices this process sees; `jaxrl memory --devices N` "
                "plans it for a target of N devices"
            )
    if not isinstance(cfg.stage, SFTConfig):  # every algorithm but SFT
        notes.append(
            f"{cfg.algorithm} is planned with the SFT loss: the same forward, backward and "
            "optimizer step; its extra per-token / per-document fp32 fields are not counted"
        )
    if cfg.trains_critic:
        notes.append(
            "ppo: the critic row is the policy's master weights, moments and gradients once "
            "more (docs/algorithms/ppo.md); its value pass and step reuse the temporaries of "
            "the policy's, which run before or after them"
        )
    if cfg.samples_rollouts:
        notes.append(
            f"{cfg.algorithm}: kv_cache_bytes sizes the prompts at the bucket of "
            f"{STAGE_SECTIONS[cfg.algorithm]}.max_prompt_length; rollout.max_slots shrinks the "
            "decode cache"
        )
    if cfg.model.dtype == AUTO:
        notes.append(
            "model.dtype=auto is planned as an accelerator runs it: bfloat16 compute (a CPU "
            "run computes in float32)"
        )
    if platform == "cpu":
        notes.append(
            "temporaries are the CPU compiler's: an accelerator's compiler fuses and schedules "
            "differently, so leave headroom"
        )
    return notes


def _size(n: int) -> str:
    """Bytes in binary units, e.g. ``1.77 GiB``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _count(n: int) -> str:
    """A parameter count, e.g. ``7.62B`` or ``396.3K``."""
    for unit, scale in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}" if unit == "B" else f"{n / scale:.1f}{unit}"
    return str(n)


def print_plan(plan: dict[str, Any], *, title: str = "", console: Any = None) -> None:
    """A :func:`plan_memory` result as a table (rich), with the run's shape and the notes."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    m = plan["model"]
    mesh = " × ".join(f"{axis}={size}" for axis, size in plan["mesh"].items())
    console.print(
        f"[bold]{title or 'memory plan'}[/bold]: {m['model_type']} "
        f"{_count(plan['num_params'])} parameters ({m['num_hidden_layers']} layers, "
        f"hidden {m['hidden_size']}, vocab {m['vocab_size']}, {m['param_dtype']}); "
        f"mesh {mesh} = {plan['devices']} {plan['platform']} devices; "
        f"{plan['max_tokens']} tokens per micro-batch row; loss: {plan['loss']}"
    )
    table = Table(title="per device (largest device)", title_justify="left")
    table.add_column("part")
    table.add_column("size", justify="right")
    table.add_column("share", justify="right")
    table.add_column("what")
    total = max(plan["total_bytes"], 1)
    compute = m["dtype"]
    copies = plan["compute_copies"]
    lora = plan.get("lora")
    master = f"{m['param_dtype']}, what AdamW updates"
    if lora:
        base = f"{m['dtype']} base" if lora["quantize"] == "none" else f"{lora['quantize']} base"
        master = (
            f"{_count(lora['trainable_params'])} fp32 adapters (rank {lora['rank']}) + frozen "
            f"{base} ({_size(lora['frozen_bytes'])})"
        )
    rows = (
        ("master weights", "params_bytes", master),
        ("optimizer", "optimizer_bytes", "AdamW fp32 moments"),
        ("gradients", "grads_bytes", "fp32 accumulator"),
        (
            "compute copies",
            "compute_copy_bytes",
            f"{copies} × {compute} (sampler" + (", reference)" if copies == 2 else ")")
            if copies
            else f"none kept: the step casts to {compute} where used",
        ),
        ("KV caches", "kv_cache_bytes", "sampler decode slots + prompt prefill"),
        ("critic", "critic_bytes", "ppo: weights, moments and gradients of the value model"),
        ("temporaries", "temp_bytes", "activations, gathered weights, ..."),
    )
    for name, key, what in rows:
        n = plan.get(key, 0)
        if key == "critic_bytes" and not n:
            continue
        table.add_row(name, _size(n), f"{100 * n / total:.0f}%", what)
    table.add_section()
    n = plan["total_bytes"]
    table.add_row("[bold]total[/bold]", f"[bold]{_size(n)}[/bold]", "100%", "")
    console.print(table)
    if plan.get("decode"):
        d = plan["decode"]
        layout = " × ".join(f"{axis}={size}" for axis, size in d["mesh"].items())
        console.print(
            f"sampler: decodes on {layout} (rollout.tensor_parallel={d['tensor_parallel']}): "
            f"{_size(d['device_weight_bytes'])} of {m['dtype']} weights per device"
        )
    console.print(
        f"XLA: arguments {_size(plan['argument_bytes'])}, outputs {_size(plan['output_bytes'])} "
        f"(aliased {_size(plan['alias_bytes'])}), temporaries "
        f"{_size(plan['compiled_temp_bytes'])}; compiled in "
        f"{plan['lower_s'] + plan['compile_s']:.1f} s"
    )
    if "fits" in plan:
        budget, hint = _size(plan["budget_bytes"]), plan["suggestion"]
        if plan["fits"]:
            console.print(f"[bold]fits[/bold] a {budget} device")
        elif hint is None:
            console.print(
                f"[bold]does not fit[/bold] a {budget} device, not even at "
                f"{MIN_FIT_TOKENS} tokens per row with more fsdp: reduce the model or its copies"
            )
        elif "schedule.max_tokens" in hint:
            console.print(
                f"[bold]does not fit[/bold] a {budget} device; schedule.max_tokens="
                f"{hint['schedule.max_tokens']} would ({_size(hint['total_bytes'])})"
            )
        else:
            console.print(
                f"[bold]does not fit[/bold] a {budget} device; mesh.fsdp={hint['mesh.fsdp']} "
                f"would, by estimate ({_size(hint['estimated_total_bytes'])}): plan it to check"
            )
    for note in plan["notes"]:
        console.print(f"note: {note}")
