"""Will it fit the hardware it targets? ``jaxrl memory CONFIG --topology NAME``: every program a
run compiles, lowered and compiled by the target's own compiler (libtpu for a TPU topology, the
CUDA plugin's XLA:GPU for a GPU node) on this machine, no accelerator present.

The run is built as :func:`jaxrl.train.run_io.memory.plan_run` builds it (abstract state,
shardings under the rule table, the real ``TrainStep``), on a mesh of the target's compile-only
devices (``jaxrl.runtime.targets``): ``mesh`` as configured, a ``-1`` axis filled from the
target's device count; with ``--slices N`` the ``data`` axis is laid across the slices
(``mesh_utils.create_hybrid_device_mesh``), the only axis that crosses the DCN. Inside
``compiling_for(platform)`` jaxrl makes its backend choices for the target (``attention_impl:
auto`` is splash on TPU, pallas_gpu on GPU). Programs (``programs[]``):

- ``train_step``: the engine's step (``shard_map`` accumulation, clipping, AdamW), planned with
  the SFT objective as the CPU plan is (GRPO / DPO add a few fp32 per-token fields);
- ``scorer``: the no-grad forward behind GRPO's old / reference log-probs, the DPO reference
  cache and held-out scoring (``jaxrl.train.score.Scorer``), on packed rows of
  ``schedule.max_tokens``;
- GRPO / PPO: ``weight_reshard`` (the trainer's weights cast into the sampler's decode layout,
  ``SamplerWeights``) and ``sampler_prefill_decode`` (the engine's one program: prompt prefill,
  then the decode-step loop, in the decode layout, for the configured generation batch).

Per program: ``peak_bytes`` = arguments + outputs - aliased + temporaries (``memory_analysis``),
``flops`` and ``bytes_accessed`` (``cost_analysis``; a loop's body is counted once, so the
sampler's figures are its prefill and one decode step), and ``roofline_s``: an estimate, the
larger of FLOPs at the chip's bf16 peak and bytes at its HBM bandwidth (``targets.CHIPS``). The
run's ``peak_bytes`` is the largest of program peak + what persists beside it (the optimizer
state beside a scorer, the sampler's weight copy beside the train step, the train state beside
the sampler). ``device_bytes``: TPU, the HBM libtpu gives a program; GPU, memory ×
``XLA_PYTHON_CLIENT_MEM_FRACTION`` minus a workspace margin (``targets.gpu_budget_bytes``). A
TPU compile over HBM fails in the compiler: :class:`DoesNotFit` carries its one line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import time
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxrl.config import ConfigError, RunConfig
from jaxrl.generate.decode_layout import sampler_mesh
from jaxrl.generate.sampler import Sampler
from jaxrl.generate.sampler_weights import reads_trainer_arrays
from jaxrl.models.attention.dispatch import resolve_attention_impl
from jaxrl.models.lora import dense_config
from jaxrl.models.sharding import avals, bytes_per_device
from jaxrl.runtime.mesh import AXES, EXPERT_AXES, batch_ranks, replicated, resolve_shape, slice_grid
from jaxrl.runtime.spmd import on_mesh, placing_abstractly
from jaxrl.runtime.targets import (
    GIB,
    Target,
    compiling_for,
    gpu_budget_bytes,
    hbm_from_message,
    target_devices,
    tpu_hbm_bytes,
)
from jaxrl.train.build import fresh_model
from jaxrl.train.run_io.memory import abstract_batch, plan_run
from jaxrl.train.score import Scorer, _param_specs

__all__ = ["DoesNotFit", "plan_target", "print_target_plan"]


class DoesNotFit(Exception):
    """A program the target's compiler refused for memory: ``str()`` is the one-line verdict."""


def target_mesh(cfg: RunConfig, target: Target, devices: list[Any]) -> tuple[Mesh, list[str]]:
    """``(mesh, dcn_axes)``: ``cfg.mesh`` over the target's devices; with several slices the
    ``data`` axis spans them (the axes named in ``dcn_axes`` cross the data-centre network)."""
    m = cfg.mesh
    expert = getattr(m, "expert", 1)
    data, fsdp, tensor = resolve_shape(m.data, m.fsdp, m.tensor, len(devices), expert=expert)
    names = EXPERT_AXES if expert > 1 else AXES
    shape = (data, fsdp, expert, tensor) if expert > 1 else (data, fsdp, tensor)
    auto = (jax.sharding.AxisType.Auto,) * len(names)
    if target.slices == 1:
        return jax.make_mesh(shape, names, devices=devices, axis_types=auto), []
    if data % target.slices:
        raise ConfigError(
            f"--slices={target.slices}: the data axis ({data}) is what crosses slices, so it "
            f"must be a multiple of {target.slices}; set mesh.data"
        )
    # the run's own layout (mesh.slices): the hybrid ICI x DCN mesh of the slices' devices
    return Mesh(slice_grid(shape, devices, target.slices), names, axis_types=auto), ["data"]


def _analyse(name: str, lowered: Any, target: Target, what: str) -> dict[str, Any]:
    """Compile ``lowered`` with the target's compiler; its memory, cost and roofline."""
    started = time.perf_counter()
    try:
        compiled = lowered.compile()
    except Exception as e:  # libtpu refuses a program over HBM at compile time
        message = str(e)
        if "RESOURCE_EXHAUSTED" in message or "Ran out of memory" in message:
            raise DoesNotFit(_verdict(name, message)) from None
        first = message.strip().splitlines()[0][:300] if message.strip() else type(e).__name__
        raise ConfigError(f"{name} does not compile for {target.name}: {first}") from None
    compile_s = time.perf_counter() - started
    mem = compiled.memory_analysis()
    cost, cost_source = _cost(compiled)
    flops = float(cost.get("flops", 0.0))
    accessed = float(cost.get("bytes accessed", 0.0))
    peak = (
        mem.argument_size_in_bytes
        + mem.output_size_in_bytes
        - mem.alias_size_in_bytes
        + mem.temp_size_in_bytes
    )
    chip = target.chip
    return {
        "name": name,
        "what": what,
        "peak_bytes": int(peak),
        "argument_bytes": int(mem.argument_size_in_bytes),
        "output_bytes": int(mem.output_size_in_bytes),
        "alias_bytes": int(mem.alias_size_in_bytes),
        "temp_bytes": int(mem.temp_size_in_bytes),
        "flops": flops,
        "bytes_accessed": accessed,
        "roofline_s": max(flops / chip.bf16_flops, accessed / chip.hbm_bandwidth),
        "cost_source": cost_source,
        "compile_s": round(compile_s, 2),
    }


def _cost(compiled: Any) -> tuple[dict[str, float], str]:
    """``(cost, source)``: the target compiler's own ``cost_analysis`` (libtpu gives one), else
    XLA's HLO cost analysis run here over the target-optimised per-device module (the CUDA
    plugin's compile-only executables report none)."""
    cost = compiled.cost_analysis()
    if isinstance(cost, list):  # older jax: one dict per program
        cost = cost[0] if cost else None
    if cost:
        return cost, "target compiler"
    from jax._src.lib import _jax

    module = compiled.runtime_executable().hlo_modules()[0]
    cpu = jax.local_devices(backend="cpu")[0].client
    return dict(
        _jax.hlo_module_cost_analysis(cpu, module)
    ), "HLO cost analysis of the optimised module"


def _verdict(name: str, message: str) -> str:
    """One line from a libtpu out-of-memory message: by how much, and what to try."""
    import re

    available = hbm_from_message(message)
    used = re.search(r"required for [^(]*\(([\d.]+)([KMGT])\)|Used ([\d.]+)([KMGT]) of", message)
    by = ""
    if used is not None and available is not None:
        value, unit = (used.group(1), used.group(2)) if used.group(1) else used.group(3, 4)
        need = float(value) * {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[unit]
        by = f" by {(need - available) / GIB:.2f} GiB ({need / GIB:.2f} GiB needed, "
        by += f"{available / GIB:.2f} GiB of HBM)"
    return (
        f"does not fit: {name} exceeds the chip's HBM{by}; try a larger topology or more "
        "mesh.fsdp, a smaller schedule.max_tokens, or model.remat (jaxrl memory --budget "
        "suggests the token budget)"
    )


def _train_step(cfg: RunConfig, run: Any, target: Target) -> dict[str, Any]:
    batch = abstract_batch(run.mesh, cfg.schedule.max_tokens)
    bounds = jax.ShapeDtypeStruct((2,), jnp.int32, sharding=replicated(run.mesh))
    frozen = None if run.frozen is None else avals(run.frozen, run.frozen_shardings)
    lowered = run.step._jitted.lower(avals(run.state, run.shardings), batch, bounds, frozen)
    what = f"{cfg.algorithm} step (SFT objective): forward, backward, AdamW"
    return _analyse("train_step", lowered, target, what)


def _scorer(cfg: RunConfig, run: Any, params: Any, target: Target) -> dict[str, Any]:
    graphdef = run.graphdef
    if run.frozen is not None:  # LoRA: the frozen base in the dense model (its reference)
        graphdef = fresh_model(dense_config(run.model_config), cfg.seed)[0]
        params = avals(run.frozen, run.frozen_shardings)
    scorer = Scorer(graphdef, mesh=run.mesh, row_len=cfg.schedule.max_tokens)
    t = cfg.schedule.max_tokens
    rows = scorer._call_rows(batch_ranks(run.mesh))
    with placing_abstractly():
        from jaxrl.runtime.spmd import put_replicated, put_rows

        batch = {
            k: put_rows(np.zeros((rows, t), np.int32), run.mesh)
            for k in ("tokens", "targets", "segment_ids", "positions")
        }
        temperature = put_replicated(np.float32(1.0), run.mesh)
    program = jax.jit(functools.partial(scorer._program, specs=_param_specs(params, run.mesh)))
    with on_mesh(run.mesh):
        lowered = program.lower(params, batch, temperature)
    what = f"no-grad log-probs of {rows} rows x {t} tokens (old / reference / DPO cache)"
    return _analyse("scorer", lowered, target, what)


def _sampler_programs(cfg: RunConfig, run: Any, target: Target) -> tuple[list, int, int]:
    """``(programs, sampler_weight_bytes, kv_cache_bytes)`` of GRPO / PPO's sampler."""
    r, g = cfg.rollout, cfg.stage.for_world_size(batch_ranks(run.mesh))
    dense = dense_config(run.model_config)
    dmesh = sampler_mesh(run.mesh, dense, r.tensor_parallel, r.weight_budget_gb)
    sampler = Sampler(
        dense, max_new_tokens=g.max_completion_length, eos_id=0, pad_id=0, mesh=dmesh,
        max_slots=r.max_slots, scan_layers=r.scan_layers, compact_slots=r.compact_slots,
    )  # fmt: skip
    requests = g.generation.size
    groups = max(requests // g.num_generations, 1)
    prompt = g.max_prompt_length or max(cfg.schedule.max_tokens - g.max_completion_length, 1)
    vocab = dense.vocab_size
    prompts = [[1 + q % (vocab - 1)] + [1] * (prompt - 1) for q in range(groups)]
    prompts = [p for p in prompts for _ in range(max(requests // groups, 1))]
    trainer = None if run.frozen is not None else avals(run.state.params, run.shardings.params)
    lowered = sampler.lower(prompts, trainer)  # LoRA merges its adapters first: no reshard
    programs = []
    if "weight_reshard" in lowered:
        what = "trainer weights cast into the decode layout (one per weight sync)"
        programs.append(_analyse("weight_reshard", lowered["weight_reshard"], target, what))
    layout = " x ".join(f"{a}={s}" for a, s in dmesh.shape.items())
    what = f"prefill {groups} prompts x {prompt} + decode loop, {requests} requests ({layout})"
    programs.append(
        _analyse("sampler_prefill_decode", lowered["sampler_prefill_decode"], target, what)
    )
    kv = sampler.memory_bytes(requests, groups, prompt)
    return programs, int(sampler.weight_bytes()), int(kv)


@contextlib.contextmanager
def _without_persistent_cache() -> Iterator[None]:
    """The persistent compilation cache off inside the block: a compile-only client cannot
    load an executable from it ("PjRtCompiler must be constructed with a Client"), and what it
    would write is of no use to a run. Restored (and re-read lazily) on exit."""
    from jax._src import compilation_cache

    enabled = jax.config.jax_enable_compilation_cache
    compilation_cache.reset_cache()
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", enabled)
        compilation_cache.reset_cache()


def plan_target(cfg: RunConfig, target: Target) -> dict[str, Any]:
    """The run ``cfg`` compiled for ``target`` (module doc): a JSON-ready dict with ``target``,
    ``compiler``, ``fits``, ``peak_bytes``, ``device_bytes`` and ``programs``. Raises
    :class:`DoesNotFit` when the target's compiler refuses a program for memory, ConfigError
    when a program does not compile there or the mesh does not match the target."""
    devices = target_devices(target)
    with compiling_for(target.platform), _without_persistent_cache():
        mesh, dcn_axes = target_mesh(cfg, target, devices)
        run = plan_run(cfg, mesh)
        params_bytes = bytes_per_device(run.state.params, run.shardings.params)
        opt_bytes = bytes_per_device(run.state.opt_state, run.shardings.opt_state)
        programs = [_train_step(cfg, run, target)]
        params = avals(run.state.params, run.shardings.params)
        programs.append(_scorer(cfg, run, params, target))
        sampler_bytes = kv_bytes = 0
        if cfg.samples_rollouts:
            extra, sampler_bytes, kv_bytes = _sampler_programs(cfg, run, target)
            programs += extra
            in_place = (
                run.frozen is None
                and cfg.rollout.max_staleness == 0
                and reads_trainer_arrays(run.model_config, scan_layers=cfg.rollout.scan_layers)
            )
            if in_place:
                sampler_bytes = 0
    beside = {  # what persists next to each program, outside its own arguments
        "train_step": sampler_bytes,
        "scorer": opt_bytes + sampler_bytes,
        "weight_reshard": opt_bytes,
        "sampler_prefill_decode": params_bytes + opt_bytes,
    }
    for p in programs:
        p["resident_bytes"] = int(beside[p["name"]])
    peak = max(p["peak_bytes"] + p["resident_bytes"] for p in programs)
    if target.platform == "tpu":
        device_bytes, device_source = tpu_hbm_bytes(devices[0])
    else:
        device_bytes, device_source = gpu_budget_bytes(target.chip)
    attention = run.model_config.attention_impl
    out = {
        "target": target.name,
        "topology": target.topology,
        "platform": target.platform,
        "compiler": target.compiler,
        "device_kind": str(devices[0].device_kind),
        "devices": len(devices),
        "slices": target.slices,
        "hosts": target.hosts,
        "mesh": {axis: int(size) for axis, size in mesh.shape.items()},
        "dcn_axes": dcn_axes,
        "algorithm": cfg.algorithm,
        "attention_impl": resolve_attention_impl(attention, target.platform),
        "num_params": int(sum(math.prod(x.shape) for x in jax.tree.leaves(run.state.params))),
        "max_tokens": cfg.schedule.max_tokens,
        "fits": bool(peak <= device_bytes),
        "peak_bytes": int(peak),
        "device_bytes": int(device_bytes),
        "device_bytes_source": device_source,
        "state_bytes": {"params": int(params_bytes), "optimizer": int(opt_bytes)},
        "sampler_weight_bytes": int(sampler_bytes),
        "kv_cache_bytes": int(kv_bytes),
        "programs": programs,
        "roofline_note": "roofline_s is an estimate: max(FLOPs / bf16 peak, bytes / HBM "
        "bandwidth) of one call; a loop body (the decode step) is counted once",
    }
    if target.platform == "gpu":
        out["spec_file"] = target.spec_path()
        out["notes"] = [
            "deviceless XLA:GPU compile: no autotuning, and a GPU compile does not fail over "
            "memory: fits compares the peak against device_bytes"
        ]
    return out


def _gib(n: float) -> str:
    from jaxrl.train.run_io.memory import _size

    return _size(int(n))


def print_target_plan(plan: dict[str, Any], *, title: str = "", console: Any = None) -> None:
    """A :func:`plan_target` result as a table (rich)."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    mesh = " x ".join(f"{a}={s}" for a, s in plan["mesh"].items())
    dcn = f"; across the DCN: {', '.join(plan['dcn_axes'])}" if plan["dcn_axes"] else ""
    console.print(
        f"[bold]{title or 'target plan'}[/bold] on {plan['target']} ({plan['topology']}, "
        f"{plan['devices']} x {plan['device_kind']}, {plan['hosts']} host(s)); compiler: "
        f"{plan['compiler']}; mesh {mesh}{dcn}; attention {plan['attention_impl']}"
    )
    table = Table(title="per device, by the target's compiler", title_justify="left")
    for col in ("program", "peak", "+ resident", "temporaries", "GFLOP", "GB accessed"):
        table.add_column(col, justify="left" if col == "program" else "right")
    table.add_column("roofline (estimate)", justify="right")
    for p in plan["programs"]:
        table.add_row(
            p["name"],
            _gib(p["peak_bytes"]),
            _gib(p["resident_bytes"]),
            _gib(p["temp_bytes"]),
            f"{p['flops'] / 1e9:,.1f}",
            f"{p['bytes_accessed'] / 1e9:,.2f}",
            f"{p['roofline_s'] * 1e3:,.2f} ms",
        )
    console.print(table)
    verdict = "fits" if plan["fits"] else "does not fit"
    console.print(
        f"[bold]{verdict}[/bold]: peak {_gib(plan['peak_bytes'])} per device against "
        f"{_gib(plan['device_bytes'])} ({plan['device_bytes_source']})"
    )
    if plan.get("spec_file"):
        console.print(f"GPU spec file: {plan['spec_file']}")
    for note in plan.get("notes", []):
        console.print(f"note: {note}")
    console.print(f"note: {plan['roofline_note']}")


def replace_max_tokens(cfg: RunConfig, tokens: int) -> RunConfig:
    """``cfg`` with ``schedule.max_tokens`` set (the table script's sweeps)."""
    return dataclasses.replace(cfg, schedule=dataclasses.replace(cfg.schedule, max_tokens=tokens))
