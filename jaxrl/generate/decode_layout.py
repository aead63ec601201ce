"""The sampler's weight layout: chosen for decoding, not for the optimizer (ZeRO-3 aside).

The trainer keeps its parameters split over ``fsdp`` (and ``tensor``); decoding in that layout
would all-gather every layer for every generated token. The sampler therefore decodes on a mesh
of its own over the same devices, ``(data = N / (t · e), fsdp = 1, tensor = t)``, with an
``expert`` axis of size e between fsdp and tensor when e > 1:

- ``t = 1``: data-parallel replicas. Every device holds the whole model in the compute dtype
  and decodes its own requests; no collective runs in the decode loop (dense models).
- ``t > 1``: groups of t devices, tensor-parallel inside a group (heads, KV heads, MLP units and
  the vocabulary split by the logical rules of ``jaxrl.models.sharding``, so each device holds
  1/t of every layer and the KV cache is split over its KV heads), data-parallel across the
  groups.
- ``e > 1`` (MoE models only): the experts are split over the ``expert`` axis as in training
  (``[E, D, F]`` kernels: E over ``expert``, F over ``tensor``), so each device holds 1/(t · e)
  of the expert weights. Requests are split over ``data`` only and replicated over ``expert``;
  in prefill and decode every MoE block runs ``jaxrl.models.moe.expert_parallel.run``: each
  device computes the (token, expert) pairs routed to its own experts and the float32 partial
  outputs are summed over the axis (the replicated-token dispatch of the train step). The
  attention, the KV cache and the routing are therefore repeated on the e devices of a group:
  e trades expert-weight memory for KV-cache rows per device. e is the run's ``mesh.expert``
  (:func:`decode_expert`; dense models: 1, their program is unchanged), reduced to a divisor of
  ``N / t`` when it does not divide it. Unlike the train step, the decode program is not manual
  over the batch axes, and ``data = 1`` (e.g. ``e = N``) compiles and decodes.

The compute-dtype copy is made in that layout once per weight sync (``sampler_weights.py``:
one jitted cast whose outputs land in the decode shardings, a reshard, never a gather onto one
device). :func:`decode_tensor` picks t when ``rollout.tensor_parallel`` is 0 (auto): the smallest
power of two, dividing the device count, for which the weights of a device (the expert weights
split over e too) fit ``rollout.weight_budget_gb``. The memory planner (``jaxrl memory``) counts
the sampler's copy and KV cache in this layout (``Sampler.weight_bytes`` reads the shardings).
See docs/moe.md, "Expert parallelism".
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh

from jaxrl.generate.sampler_weights import decode_model
from jaxrl.models.model_config import ModelConfig
from jaxrl.runtime.errors import ConfigError
from jaxrl.runtime.mesh import AXES, EXPERT_AXES, EXPERT_AXIS

GB = 1e9
_EXPERT_KERNELS = ("expert_gate_kernel", "expert_up_kernel", "expert_down_kernel")


def _bytes(config: ModelConfig) -> tuple[int, int]:
    """``(whole, experts)``: bytes of the sampler's parameters in the compute dtype, and of its
    expert kernels among them (``[E, ...]``, split over the ``expert`` axis)."""
    _, _, abstract = decode_model(config)
    whole = experts = 0
    for path, x in jax.tree.leaves_with_path(abstract):
        n = x.size * np.dtype(x.dtype).itemsize
        whole += n
        if any(name in jax.tree_util.keystr(path) for name in _EXPERT_KERNELS):
            experts += n
    return whole, experts


def weight_bytes(config: ModelConfig) -> int:
    """Bytes of the model's parameters in the compute dtype (the sampler's copy, whole), from
    the abstract parameters of the model the sampler runs (``sampler_weights.decode_model``)."""
    whole, _ = _bytes(config)
    return whole


def decode_expert(config: ModelConfig, devices: int, tensor: int, expert: int) -> int:
    """The decode layout's expert-parallel degree e: 1 for a dense model, else the largest
    divisor of ``expert`` (the run's ``mesh.expert``) that divides ``devices / tensor``."""
    if not config.num_experts:
        return 1
    return math.gcd(expert, devices // tensor)


def decode_tensor(
    config: ModelConfig, devices: int, requested: int, budget_gb: float, expert: int = 1
) -> int:
    """The decode layout's tensor-parallel degree t: ``requested`` when > 0 (checked), else the
    smallest power of two dividing ``devices`` for which a device's weights (the expert
    kernels split over :func:`decode_expert`'s e as well) fit ``budget_gb`` (all of
    ``devices`` when none does)."""
    if requested > 0:
        if devices % requested:
            raise ConfigError(
                f"rollout.tensor_parallel={requested} does not divide the {devices} generation "
                "devices: use a divisor, or 0 (auto)"
            )
        return requested
    whole, experts = _bytes(config)

    def per_device(t: int) -> float:
        e = decode_expert(config, devices, t, expert)
        return (whole - experts + experts / e) / t

    t = 1
    while t < devices and (per_device(t) > budget_gb * GB or devices % t):
        t *= 2
    return t if devices % t == 0 else devices


def decode_mesh(mesh: Mesh, tensor: int, expert: int = 1) -> Mesh:
    """The sampler's mesh over ``mesh``'s devices (in their order): ``(data = N / (tensor ·
    expert), fsdp = 1, tensor)``, with an ``expert`` axis before ``tensor`` when ``expert`` > 1;
    ``mesh`` itself when it already has that shape."""
    n = mesh.devices.size
    devices = list(mesh.devices.flat)
    if expert == 1:
        if tuple(mesh.shape.get(a, 1) for a in AXES) == (n // tensor, 1, tensor):
            return mesh
        return _in_order(devices, (n // tensor, 1, tensor), AXES)
    if n % (tensor * expert):
        raise ConfigError(
            f"the sampler's decode mesh: tensor={tensor} × expert={expert} does not divide the "
            f"{n} generation devices: set rollout.tensor_parallel to a divisor of {n // expert}"
        )
    shape = (n // (tensor * expert), 1, expert, tensor)
    if mesh.axis_names == EXPERT_AXES and tuple(mesh.devices.shape) == shape:
        return mesh
    # built directly: ``make_mesh`` refuses data × fsdp = 1 with an expert axis (a limit of the
    # train step's batch-manual program, not of the decode program: module doc)
    return _in_order(devices, shape, EXPERT_AXES)


def _in_order(devices: list, shape: tuple[int, ...], names: tuple[str, ...]) -> Mesh:
    """A mesh of ``devices`` reshaped in their order. Not ``jax.make_mesh``: on a TPU it
    reorders devices by their physical coordinates, and the weight copy from the trainer's mesh
    into the decode layout is then refused by ``jit`` ("incompatible devices": its inputs' and
    outputs' device orders differ; found by compiling for a v5p topology, docs/scale_out.md)."""
    auto = (jax.sharding.AxisType.Auto,) * len(names)
    return Mesh(np.asarray(devices, dtype=object).reshape(shape), names, axis_types=auto)


def sampler_mesh(mesh: Mesh, config: ModelConfig, requested: int, budget_gb: float) -> Mesh:
    """The sampler's mesh over ``mesh``'s devices: :func:`decode_mesh` with the
    :func:`decode_tensor` degree (``rollout.tensor_parallel``, ``rollout.weight_budget_gb``)
    and, for a MoE model, the :func:`decode_expert` degree (the run's ``mesh.expert``)."""
    expert = mesh.shape.get(EXPERT_AXIS, 1)
    tensor = decode_tensor(config, mesh.size, requested, budget_gb, expert)
    return decode_mesh(mesh, tensor, decode_expert(config, mesh.size, tensor, expert))
