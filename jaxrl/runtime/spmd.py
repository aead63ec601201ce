"""Running a no-grad program (scoring, sampling) with its rows split over a mesh's batch axes.

Layout. Rows (packed rows, prompts) are split over the batch axes, data × fsdp
(:func:`jaxrl.runtime.mesh.batch_sharding`); tensor ranks share rows. The caller pads the row
count to a multiple of :func:`row_ranks`. Parameters stay in whatever sharding they have: ``jit``
follows committed inputs, so a replicated, fsdp- or tensor-sharded state is used where it lies.
Host inputs enter with :func:`put_rows` / :func:`put_replicated` (each process reads only the
blocks its devices hold) and results leave with :func:`jaxrl.runtime.mesh.to_host`, so every
process gets the same host outputs.

Partitioning. Meshes from :func:`jaxrl.runtime.mesh.make_mesh` have automatic axes: XLA propagates
the shardings of the inputs, gathering fsdp-sharded weights and splitting tensor-sharded heads,
as in the train step. :func:`on_mesh` is the mesh context in which :func:`constrain_rows`'s
PartitionSpecs are traced.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl.runtime.mesh import BATCH_AXES, TENSOR_AXIS, batch_ranks, batch_sharding, put_global


def manual_batch_axes(mesh: Mesh) -> tuple[str, ...]:
    """The batch axes a per-rank program is manual over (``shard_map``): those of size > 1,
    or ``data`` alone on a one-device mesh (the same program as data parallelism); empty when
    only ``tensor`` has several devices (XLA then partitions the whole program)."""
    manual = tuple(axis for axis in BATCH_AXES if mesh.shape.get(axis, 1) > 1)
    if not manual and mesh.size == 1:
        manual = (BATCH_AXES[0],)
    return manual


def row_ranks(mesh: Mesh | None) -> int:
    """Row shards: data × fsdp (``jaxrl.runtime.mesh.batch_ranks``); 1 without a mesh."""
    return 1 if mesh is None else batch_ranks(mesh)


def put_rows(host: np.ndarray, mesh: Mesh | None) -> jax.Array | np.ndarray:
    """A host array of the GLOBAL shape ``[N, ...]`` (N a multiple of :func:`row_ranks`) split
    over the batch axes; without a mesh the host array itself (``jit`` places it with the
    parameters)."""
    if mesh is None:
        return np.asarray(host)
    return _place(np.asarray(host), batch_sharding(mesh))


def put_replicated(host: Any, mesh: Mesh | None) -> jax.Array | np.ndarray:
    """A small host value (scalar, key data) replicated over the mesh."""
    if mesh is None:
        return np.asarray(host)
    return _place(np.asarray(host), NamedSharding(mesh, P()))


_abstract: list[bool] = []  # placing_abstractly() blocks open


@contextlib.contextmanager
def placing_abstractly() -> Iterator[None]:
    """Inside the block :func:`put_rows` / :func:`put_replicated` place nothing: they return
    the ``jax.ShapeDtypeStruct`` (shape, dtype, sharding) the array would have, so a program's
    arguments can be lowered for devices that cannot hold buffers (a target compile's
    compile-only devices, ``jaxrl memory --topology``)."""
    _abstract.append(True)
    try:
        yield
    finally:
        _abstract.pop()


def _place(host: np.ndarray, sharding: NamedSharding) -> jax.Array | jax.ShapeDtypeStruct:
    if _abstract:
        return jax.ShapeDtypeStruct(host.shape, host.dtype, sharding=sharding)
    return put_global(host, sharding)


@contextlib.contextmanager
def on_mesh(mesh: Mesh | None) -> Iterator[None]:
    """``jax.set_mesh(mesh)`` around tracing and calling a program (nothing without a mesh)."""
    if mesh is None:
        yield
        return
    with jax.set_mesh(mesh):
        yield


def constrain_rows(
    x: jax.Array, mesh: Mesh | None, axis: int = 0, tensor_axis: int | None = None
) -> jax.Array:
    """Inside a program: keep dimension ``axis`` of ``x`` split over the batch axes, and
    dimension ``tensor_axis`` (e.g. a KV cache's KV heads) over ``tensor`` when it divides."""
    if mesh is None:
        return x
    spec = [None] * x.ndim
    spec[axis] = BATCH_AXES
    size = mesh.shape.get(TENSOR_AXIS, 1)
    if tensor_axis is not None and size > 1 and x.shape[tensor_axis] % size == 0:
        spec[tensor_axis] = TENSOR_AXIS
    return jax.lax.with_sharding_constraint(x, P(*spec))


def on_mesh_devices(x: Any, mesh: Mesh) -> bool:
    """Whether ``x`` is a committed array that lies on exactly the mesh's devices."""
    if not isinstance(x, jax.Array) or not x.committed:
        return False
    return x.sharding.device_set == set(mesh.devices.flat)
