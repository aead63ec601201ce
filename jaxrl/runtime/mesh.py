"""The device mesh ``(data, fsdp, tensor)`` and moving host batches onto it.

Axes:
- ``data``: data parallelism. The train step's accumulation loop is manual (``shard_map``) over
  this axis; parameters are replicated along it.
- ``fsdp``: parameters and optimizer moments are sharded along it (``embed`` dimension) and
  batches are split over it too, so it is also a data-parallel axis ("batch axes" = data ×
  fsdp); XLA gathers the weights per layer (automatic partitioning).
- ``tensor``: attention heads, MLP hidden units and the vocabulary are split along it; batches
  are replicated along it.
- ``expert`` (only when ``mesh.expert > 1``, between fsdp and tensor): a MoE model's experts
  are split along it (``jaxrl.models.moe``); batches are replicated along it, each device
  computes the token pairs routed to its own experts.

The product of the three sizes must equal the number of devices the run uses: every visible
device, or those set by :func:`use_devices` (e.g. a notebook leaving a GPU to an inference
server; with ``subset=True`` a pool from which each mesh takes the first devices it needs, as
the test suite does with its 8 host devices). One axis may be ``-1`` (the rest). A host batch
``[R, ...]`` has one leading entry per batch rank ``r = d · fsdp + f``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl.runtime.errors import ConfigError

AXES = ("data", "fsdp", "tensor")
DATA_AXIS, FSDP_AXIS, TENSOR_AXIS = AXES
EXPERT_AXIS = "expert"  # a fourth axis, present only when its size is > 1
EXPERT_AXES = (DATA_AXIS, FSDP_AXIS, EXPERT_AXIS, TENSOR_AXIS)
BATCH_AXES = (DATA_AXIS, FSDP_AXIS)

_devices: list[tuple[list[Any], bool]] = []  # stack of use_devices() selections


@contextlib.contextmanager
def use_devices(devices: Sequence[Any], *, subset: bool = False) -> Iterator[None]:
    """Build meshes inside this block from ``devices`` instead of every visible device.

    ``subset``: ``devices`` is a pool; a mesh of fixed size N <= len(devices) takes the first
    N (an axis of -1 takes the whole pool). Without it the mesh must use them all.
    """
    _devices.append((list(devices), subset))
    try:
        yield
    finally:
        _devices.pop()


@contextlib.contextmanager
def reserve_devices(count: int, what: str = "rollout.devices") -> Iterator[list[Any]]:
    """Set the last ``count`` devices of the current pool (:func:`use_devices`, else every
    visible device) aside, e.g. for generation: meshes built inside the block use the others.
    Yields the reserved devices ([] when ``count`` is 0, and nothing changes)."""
    if count == 0:
        yield []
        return
    devices, subset = _devices[-1] if _devices else (list(jax.devices()), False)
    if count >= len(devices):
        raise ConfigError(
            f"{what}={count} sets {count} of the {len(devices)} devices aside, which leaves none "
            "to train on: use fewer"
        )
    with use_devices(devices[:-count], subset=subset):
        yield devices[-count:]


def run_devices(sizes: Sequence[int] | None = None) -> list[Any]:
    """The devices a mesh of ``sizes`` (data, fsdp, tensor) is built from: the innermost
    :func:`use_devices`, else every visible device."""
    if not _devices:
        return list(jax.devices())
    devices, subset = _devices[-1]
    if subset and sizes is not None and -1 not in sizes:
        wanted = math.prod(sizes)
        if wanted <= len(devices):
            return devices[:wanted]
    return list(devices)


def resolve_shape(
    data: int, fsdp: int, tensor: int, num_devices: int, *, expert: int = 1
) -> tuple[int, int, int]:
    """Mesh sizes (data, fsdp, tensor) with a ``-1`` replaced by the rest; ConfigError unless
    the product, times ``expert``, is ``num_devices``."""
    if not isinstance(expert, int) or expert < 1:
        raise ConfigError(f"mesh.expert={expert} is invalid: use a positive size (1: no axis)")
    sizes = {"data": data, "fsdp": fsdp, "tensor": tensor}
    if expert > 1:
        sizes = {"data": data, "fsdp": fsdp, "expert": expert, "tensor": tensor}
    for name, size in sizes.items():
        if size == 0 or size < -1:
            raise ConfigError(
                f"mesh.{name}={size} is invalid: use a positive size, or -1 = the rest"
            )
    rest = [name for name, size in sizes.items() if size == -1]
    if len(rest) > 1:
        raise ConfigError(
            f"mesh.{rest[0]} and mesh.{rest[1]} are both -1: at most one axis may take the rest"
        )
    known = math.prod(size for size in sizes.values() if size != -1)
    if rest:
        if num_devices % known:
            raise ConfigError(
                f"mesh.{rest[0]}=-1 cannot fill the mesh: the other axes use {known} devices, "
                f"which does not divide the {num_devices} devices; change the mesh sizes"
            )
        sizes[rest[0]] = num_devices // known
    product = math.prod(sizes.values())
    if product != num_devices:
        shape = " × ".join(f"{n}={s}" for n, s in sizes.items())
        raise ConfigError(
            f"mesh {shape} uses {product} devices but {num_devices} devices are visible: make "
            f"the product of mesh.data, mesh.fsdp, mesh.expert and mesh.tensor equal {num_devices} "
            "(one of them "
            "may be -1 = the rest); on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N "
            "sets the device count"
        )
    if expert > 1 and sizes["data"] * sizes["fsdp"] == 1:
        raise ConfigError(
            f"mesh.expert={expert} with data × fsdp = 1 is not supported yet (XLA rejects the "
            "expert all-reduce outside a batch-parallel program): give the batch axes at least 2 "
            "devices, e.g. mesh.data=2"
        )
    return sizes["data"], sizes["fsdp"], sizes["tensor"]


def make_mesh(
    data: int = -1,
    fsdp: int = 1,
    tensor: int = 1,
    *,
    expert: int = 1,
    slices: int = 1,
    devices: Sequence[Any] | None = None,
) -> Mesh:
    """A ``(data, fsdp, tensor)`` mesh over ``devices`` (default :func:`run_devices`);
    ``(data, fsdp, expert, tensor)`` when ``expert > 1``; with ``slices > 1`` (multislice)
    the data axis is laid across the slices, every other axis within one (:func:`slice_grid`)."""
    devices = run_devices((data, fsdp, tensor, expert)) if devices is None else list(devices)
    shape = resolve_shape(data, fsdp, tensor, len(devices), expert=expert)
    names = AXES
    if expert > 1:
        shape, names = (shape[0], shape[1], expert, shape[2]), EXPERT_AXES
    auto = (jax.sharding.AxisType.Auto,) * len(names)  # XLA partitions; no sharding in types
    if slices > 1:
        return Mesh(slice_grid(shape, devices, slices), names, axis_types=auto)
    return jax.make_mesh(shape, names, devices=devices, axis_types=auto)


def slice_grid(shape: Sequence[int], devices: Sequence[Any], slices: int) -> np.ndarray:
    """``devices`` as an array of ``shape`` (data axis first) whose data axis crosses
    ``slices`` slices and whose other axes (fsdp's all-gathers, tensor's all-reduces) stay
    inside one, on the fast ICI; only the data axis's gradient all-reduce crosses the slower
    data-centre network (DCN). Devices that know their slice (``slice_index``: a TPU
    multislice job) go through ``mesh_utils.create_hybrid_device_mesh``; others (CPU, GPU)
    are taken as ``slices`` consecutive blocks of devices, one per slice."""
    shape = tuple(shape)
    if slices < 1 or len(devices) % slices or shape[0] % slices:
        raise ConfigError(
            f"mesh.slices={slices} is invalid for a mesh of {shape} over {len(devices)} "
            f"devices: the data axis ({shape[0]}) is the one that crosses slices, so it must "
            f"be a multiple of mesh.slices; set mesh.data (e.g. mesh.data={slices})"
        )
    ici = (shape[0] // slices, *shape[1:])
    dcn = (slices,) + (1,) * (len(shape) - 1)
    if all(getattr(d, "slice_index", None) is not None for d in devices):
        from jax.experimental import mesh_utils

        return mesh_utils.create_hybrid_device_mesh(
            ici, dcn, list(devices), allow_split_physical_axes=True
        )
    per = len(devices) // slices
    blocks = [list(devices[i * per : (i + 1) * per]) for i in range(slices)]
    return np.concatenate([np.asarray(b, dtype=object).reshape(ici) for b in blocks], axis=0)


def mesh_from_config(mesh_cfg: Any, *, devices: Sequence[Any] | None = None) -> Mesh:
    """The mesh a ``MeshConfig`` (``mesh`` section) describes."""
    expert = getattr(mesh_cfg, "expert", 1)
    slices = getattr(mesh_cfg, "slices", 1)
    return make_mesh(
        mesh_cfg.data, mesh_cfg.fsdp, mesh_cfg.tensor, expert=expert, slices=slices, devices=devices
    )


def batch_ranks(mesh: Mesh) -> int:
    """Data-parallel ranks: ``data × fsdp`` (each gets its own rows)."""
    return mesh.shape[DATA_AXIS] * mesh.shape[FSDP_AXIS]


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading axis split over the batch axes, the rest replicated (tensor ranks share rows)."""
    return NamedSharding(mesh, P(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def put_global(host: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global array from a host array of the GLOBAL shape, of which each process reads only
    the blocks its own devices hold (so the other blocks may be left unfilled)."""
    host = np.asarray(host)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def put_batch(arrays: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """Host ``[R, ...]`` arrays onto the mesh, split over the batch axes."""
    sharding = batch_sharding(mesh)
    return {name: put_global(value, sharding) for name, value in arrays.items()}


def local_ranks(mesh: Mesh) -> list[int]:
    """Batch ranks ``d · fsdp + f`` that have a device in this process (all, single-process)."""
    fsdp = mesh.shape[FSDP_AXIS]
    mine = set()
    for index, device in np.ndenumerate(mesh.devices):
        if device.process_index == jax.process_index():
            mine.add(index[0] * fsdp + index[1])  # data, fsdp lead in both layouts
    return sorted(mine)


def to_host(tree: Any) -> Any:
    """Every leaf as a numpy array on every process (gathers arrays spread over processes)."""

    def one(x: Any) -> np.ndarray:
        if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(x)

    return jax.tree.map(one, tree)


def is_primary() -> bool:
    """Process 0: the one that writes metrics, configs, plots and exports."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Wait until every process reaches ``name`` (no-op with one process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def from_primary(compute: Callable[[], np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
    """Process 0's ``compute()`` (a float64 array of ``shape``) on every process, computed once:
    the other processes do not call it and receive its bits (NaN and all; float64 travels as
    int32 pairs, since jax without x64 would round it). When process 0's call raises, it raises
    there and every other process raises ``RuntimeError`` naming process 0's log, instead of
    waiting forever."""
    if jax.process_count() == 1:
        return np.asarray(compute(), np.float64).reshape(shape)
    size = math.prod(shape)
    payload = np.zeros(1 + 2 * size, np.int32)
    error: Exception | None = None
    if jax.process_index() == 0:
        try:
            value = np.ascontiguousarray(np.asarray(compute(), np.float64).reshape(shape))
            payload[0], payload[1:] = 1, value.reshape(-1).view(np.int32)
        except Exception as e:  # sent as a flag; raised here after the broadcast
            error = e
    got = np.asarray(multihost_utils.broadcast_one_to_all(payload))
    if error is not None:
        raise error
    if not got[0]:
        raise RuntimeError(
            f"process 0 failed computing what every process needs (this is process "
            f"{jax.process_index()} of {jax.process_count()}): see process 0's error"
        )
    return np.ascontiguousarray(got[1:]).view(np.float64).reshape(shape)


def agreed(flag: bool) -> bool:
    """Process 0's ``flag`` on every process (e.g. "does this file exist?" on a shared disk
    that processes may see at different moments)."""
    if jax.process_count() == 1:
        return bool(flag)
    return bool(multihost_utils.broadcast_one_to_all(np.asarray(flag)))
