"""The sampler's weight layout: chosen for decoding, not for the optimizer (ZeRO-3 aside).

The trainer keeps its parameters split over ``fsdp`` (and ``tensor``); decoding in that layout
would all-gather every layer for every generated token. The sampler therefore decodes on a mesh
of its own over the same devices, ``(data = N / t, fsdp = 1, tensor = t)``:

- ``t = 1``: data-parallel replicas. Every device holds the whole model in the compute dtype
  and decodes its own requests; no collective runs in the decode loop.
- ``t > 1``: groups of t devices, tensor-parallel inside a group (heads, KV heads, MLP units and
  the vocabulary split by the logical rules of ``jaxrl.models.sharding``, so each device holds
  1/t of every layer and the KV cache is split over its KV heads), data-parallel across the
  N / t groups.

The compute-dtype copy is made in that layout once per weight sync (``sampler_weights.py``:
one jitted cast whose outputs land in the decode shardings, a reshard, never a gather onto one
device). :func:`decode_tensor` picks t when ``rollout.tensor_parallel`` is 0 (auto): the smallest
power of two, dividing the device count, for which the weights of a device fit
``rollout.weight_budget_gb``. The memory planner (``jaxrl memory``) counts the sampler's copy
and KV cache in this layout.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh

from jaxrl.generate.sampler_weights import sampler_model
from jaxrl.models.model_config import ModelConfig
from jaxrl.runtime.errors import ConfigError
from jaxrl.runtime.mesh import AXES, make_mesh

GB = 1e9


def weight_bytes(config: ModelConfig) -> int:
    """Bytes of the model's parameters in the compute dtype (the sampler's copy, whole), from
    the abstract parameters of the model the sampler runs (``sampler_weights.sampler_model``)."""
    abstract = sampler_model(config)[2]
    return sum(x.size * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(abstract))


def decode_tensor(config: ModelConfig, devices: int, requested: int, budget_gb: float) -> int:
    """The decode layout's tensor-parallel degree t: ``requested`` when > 0 (checked), else the
    smallest power of two dividing ``devices`` for which ``weight_bytes / t`` fits
    ``budget_gb`` (all of ``devices`` when none does)."""
    if requested > 0:
        if devices % requested:
            raise ConfigError(
                f"rollout.tensor_parallel={requested} does not divide the {devices} generation "
                "devices: use a divisor, or 0 (auto)"
            )
        return requested
    whole = weight_bytes(config)
    t = 1
    while t < devices and (whole / t > budget_gb * GB or devices % t):
        t *= 2
    return t if devices % t == 0 else devices


def decode_mesh(mesh: Mesh, tensor: int) -> Mesh:
    """The sampler's mesh over ``mesh``'s devices (in their order): ``(data = N / tensor,
    fsdp = 1, tensor)``; ``mesh`` itself when it already has that shape."""
    n = mesh.devices.size
    if tuple(mesh.shape.get(a, 1) for a in AXES) == (n // tensor, 1, tensor):
        return mesh
    return make_mesh(n // tensor, 1, tensor, devices=list(mesh.devices.flat))


def sampler_mesh(mesh: Mesh, config: ModelConfig, requested: int, budget_gb: float) -> Mesh:
    """The sampler's mesh over ``mesh``'s devices: :func:`decode_mesh` with the
    :func:`decode_tensor` degree (``rollout.tensor_parallel``, ``rollout.weight_budget_gb``)."""
    return decode_mesh(mesh, decode_tensor(config, mesh.size, requested, budget_gb))
