"""Running a no-grad program (scoring, sampling) with its rows split over a mesh's batch axes.

Layout. Rows (packed rows, prompts) are split over the batch axes, data × fsdp
(:func:`jaxrl.train.mesh.batch_sharding`); tensor ranks share rows. The caller pads the row
count to a multiple of :func:`row_ranks`. Parameters stay in whatever sharding they have: ``jit``
follows committed inputs, so a replicated, fsdp- or tensor-sharded state is used where it lies.
Host inputs enter with :func:`put_rows` / :func:`put_replicated` (each process reads only the
blocks its devices hold) and results leave with :func:`jaxrl.train.mesh.to_host`, so every
process gets the same host outputs.

Partitioning. Meshes from :func:`jaxrl.train.mesh.make_mesh` have Explicit axes (sharding in
types); the model is written for automatic partitioning (XLA propagates the shardings of the
inputs, gathering fsdp-sharded weights and splitting tensor-sharded heads, as in the train step).
:func:`auto_partitioned` therefore runs a program body with every mesh axis automatic
(``jax.sharding.auto_axes``), and :func:`on_mesh` is the mesh context to trace and call it in.

A mesh that has only a ``data`` axis (the 1-D mesh ``jaxrl.train.step.make_mesh`` builds) is
accepted too: its batch axes are those it has.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl.train.mesh import BATCH_AXES, put_global


def batch_axes(mesh: Mesh) -> tuple[str, ...]:
    """The batch axes (data, fsdp) that ``mesh`` has, in mesh order."""
    return tuple(a for a in BATCH_AXES if a in mesh.axis_names)


def row_ranks(mesh: Mesh | None) -> int:
    """Row shards: data × fsdp (``jaxrl.train.mesh.batch_ranks``); 1 without a mesh."""
    if mesh is None:
        return 1
    return math.prod(mesh.shape[a] for a in batch_axes(mesh))


def row_spec(mesh: Mesh) -> P:
    """Leading axis over the batch axes, the rest replicated."""
    return P(batch_axes(mesh))


def put_rows(host: np.ndarray, mesh: Mesh | None) -> jax.Array | np.ndarray:
    """A host array of the GLOBAL shape ``[N, ...]`` (N a multiple of :func:`row_ranks`) split
    over the batch axes; without a mesh the host array itself (``jit`` places it with the
    parameters)."""
    if mesh is None:
        return np.asarray(host)
    return put_global(np.asarray(host), NamedSharding(mesh, row_spec(mesh)))


def put_replicated(host: Any, mesh: Mesh | None) -> jax.Array | np.ndarray:
    """A small host value (scalar, key data) replicated over the mesh."""
    if mesh is None:
        return np.asarray(host)
    return put_global(np.asarray(host), NamedSharding(mesh, P()))


def has_explicit_axes(mesh: Mesh | None) -> bool:
    return mesh is not None and any(t == AxisType.Explicit for t in mesh.axis_types)


def auto_partitioned(fn: Callable[..., Any], mesh: Mesh | None, out_specs: Any) -> Callable:
    """``fn`` with every mesh axis automatic inside (when ``mesh`` has Explicit axes), its
    outputs sharded as ``out_specs`` (a PartitionSpec tree). Call it under :func:`on_mesh`."""
    if not has_explicit_axes(mesh):
        return fn
    return jax.sharding.auto_axes(fn, out_sharding=out_specs)


@contextlib.contextmanager
def on_mesh(mesh: Mesh | None) -> Iterator[None]:
    """``jax.set_mesh(mesh)`` around tracing and calling a program (nothing without a mesh)."""
    if mesh is None:
        yield
        return
    with jax.set_mesh(mesh):
        yield


def constrain_rows(x: jax.Array, mesh: Mesh | None, axis: int = 0) -> jax.Array:
    """Inside a program: keep dimension ``axis`` of ``x`` split over the batch axes."""
    if mesh is None:
        return x
    spec = [None] * x.ndim
    spec[axis] = batch_axes(mesh)
    return jax.lax.with_sharding_constraint(x, P(*spec))


def on_mesh_devices(x: Any, mesh: Mesh) -> bool:
    """Whether ``x`` is a committed array that lies on exactly the mesh's devices."""
    if not isinstance(x, jax.Array) or not x.committed:
        return False
    return x.sharding.device_set == set(mesh.devices.flat)
