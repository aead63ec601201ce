"""The hardware a plan compiles for: TPU topologies and GPU nodes, their compile-only devices and
the chip numbers a roofline estimate needs (``jaxrl memory --topology``, docs/scale_out.md).

Names (:func:`parse_target`):

- a TPU topology as libtpu spells it, ``v5p:2x2x2``, ``v5e:4x4``, ``v4:2x2x2``, ``v6e:16x16``
  (chips per dimension);
- a booked slice, ``v5p-16``, ``v5e-16``, ``v6e-256``, ``v4-32``: the number is TensorCores for
  v4 and v5p (two per chip, driven as one megacore device: ``v5p-16`` is 8 chips) and chips for
  v5e and v6e (one core each), mapped to a topology by :data:`SLICE_SHAPES`;
- a GPU node, ``h100:8``, ``h200:8``, ``b200:8``, ``a100-80g:8`` (GPUs per node; ``nodes``
  of them).

The compilers: libtpu (``pip install jaxrl[tpu-plan]``) compiles for any TPU topology with no
TPU present; the CUDA PJRT plugin (``jaxrl[gpu-plan]``) compiles without a GPU when given a
``GpuTargetConfigProto`` (the spec files in ``gpu_specs/``, whose numbers are NVIDIA's, as XLA's
own spec files for these parts record them: openxla/xla ``xla/backends/gpu/target_config/
specs/``). :func:`target_devices` returns the compile-only devices; nothing runs on them.

:data:`CHIPS`: per-chip bf16 dense peak, HBM bandwidth and HBM size, from the vendors' published
specifications (cloud.google.com/tpu/docs/v4, /v5e, /v5p, /v6e; NVIDIA's H100, H200, B200 and
A100 datasheets, SXM parts). The TPU HBM a compile may use is what libtpu reports, read from its
own out-of-memory message (:func:`tpu_hbm_bytes`), the table's value only when that fails.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
from collections.abc import Iterator
from importlib import resources
from typing import Any

from jaxrl.runtime.errors import ConfigError

__all__ = [
    "CHIPS",
    "SLICE_SHAPES",
    "Chip",
    "Target",
    "compiling_for",
    "parse_target",
    "target_devices",
    "target_platform",
]

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator chip (or GPU): what the roofline and the memory verdict use."""

    name: str
    bf16_flops: float  # dense bf16 peak, FLOP/s per device
    hbm_bandwidth: float  # bytes/s
    hbm_bytes: int  # nominal memory per device
    cores: int = 1  # TensorCores behind one device (megacore)
    spec_file: str | None = None  # GPU: the GpuTargetConfigProto in gpu_specs/
    source: str = ""


CHIPS: dict[str, Chip] = {
    "v4": Chip("v4", 275e12, 1228e9, 32 * GIB, 2, source="cloud.google.com/tpu/docs/v4"),
    "v5e": Chip("v5e", 197e12, 819e9, 16 * GIB, 1, source="cloud.google.com/tpu/docs/v5e"),
    "v5p": Chip("v5p", 459e12, 2765e9, 95 * GIB, 2, source="cloud.google.com/tpu/docs/v5p"),
    "v6e": Chip("v6e", 918e12, 1640e9, 32 * GIB, 1, source="cloud.google.com/tpu/docs/v6e"),
    "h100": Chip(
        "h100", 989e12, 3.35e12, 84942979072, spec_file="h100_sxm.txtpb",
        source="NVIDIA H100 datasheet (SXM5 80GB: 989 TFLOP/s dense bf16, 3.35 TB/s)",
    ),
    "h200": Chip(
        "h200", 989e12, 4.8e12, 151397597184, spec_file="h200.txtpb",
        source="NVIDIA H200 datasheet (SXM 141GB: 989 TFLOP/s dense bf16, 4.8 TB/s)",
    ),
    "b200": Chip(
        "b200", 2.25e15, 7.67e12, 191514411008, spec_file="b200.txtpb",
        source="NVIDIA DGX B200 datasheet (2.25 PFLOP/s dense bf16 per GPU, 8 TB/s)",
    ),
    "a100-80g": Chip(
        "a100-80g", 312e12, 2.039e12, 85100068864, spec_file="a100_sxm_80.txtpb",
        source="NVIDIA A100 datasheet (SXM 80GB: 312 TFLOP/s dense bf16, 2.039 TB/s)",
    ),
}  # fmt: skip

# booked slice name -> chips; v4 / v5p names count TensorCores (2 per chip)
_CORES_PER_NAME_UNIT = {"v4": 2, "v5p": 2, "v5e": 1, "v6e": 1}
SLICE_SHAPES: dict[str, dict[int, str]] = {  # chips -> topology, the shapes GCE provisions
    "v4": {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8"},
    "v5p": {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8"},
    "v5e": {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16",
            256: "16x16"},
    "v6e": {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16",
            256: "16x16"},
}  # fmt: skip
CHIPS_PER_HOST = {"v4": 4, "v5p": 4, "v5e": 4, "v6e": 4}  # hosts of a multi-host slice
SINGLE_HOST_CHIPS = {"v4": 4, "v5p": 4, "v5e": 8, "v6e": 8}  # the largest one-host slice
GPU_MEM_FRACTION = 0.75  # XLA_PYTHON_CLIENT_MEM_FRACTION's default: what JAX preallocates
GPU_WORKSPACE_BYTES = 1 * GIB  # left to cuBLAS / NCCL / cuDNN workspaces outside XLA's buffers


@dataclasses.dataclass(frozen=True)
class Target:
    """A parsed ``--topology``: ``platform`` ``"tpu"`` or ``"gpu"``, the chip, the topology
    string the compiler takes, devices per slice and the slice (TPU) or node (GPU) count."""

    name: str
    platform: str
    chip: Chip
    topology: str
    devices_per_slice: int
    slices: int = 1

    @property
    def num_devices(self) -> int:
        return self.devices_per_slice * self.slices

    @property
    def hosts(self) -> int:
        if self.platform == "gpu":
            return self.slices
        chips = self.devices_per_slice
        if chips <= SINGLE_HOST_CHIPS[self.chip.name]:
            return self.slices
        return self.slices * chips // CHIPS_PER_HOST[self.chip.name]

    @property
    def compiler(self) -> str:
        return "libtpu (XLA:TPU)" if self.platform == "tpu" else "XLA:GPU (CUDA PJRT plugin)"

    def spec_path(self) -> str | None:
        """The GPU spec file shipped in the package (None on TPU)."""
        if self.chip.spec_file is None:
            return None
        return str(resources.files("jaxrl.runtime") / "gpu_specs" / self.chip.spec_file)


_TPU_TOPOLOGY = re.compile(r"^(v4|v5p|v5e|v6e):(\d+(?:x\d+){1,2})$")
_TPU_SLICE = re.compile(r"^(v4|v5p|v5e|v5litepod|v6e)-(\d+)$")
_GPU_NODE = re.compile(r"^([a-z0-9-]+):(\d+)$")


def parse_target(name: str, *, slices: int = 1, nodes: int = 1) -> Target:
    """The :class:`Target` ``name`` describes (module doc); ``slices``: TPU slices (multislice,
    the ``data`` axis across them); ``nodes``: GPU nodes. ConfigError for an unknown name."""
    if slices < 1 or nodes < 1:
        raise ConfigError(f"--slices={slices} / --nodes={nodes}: use positive counts")
    key = name.strip().lower()
    m = _TPU_TOPOLOGY.match(key)
    if m:
        chip, shape = m.group(1), m.group(2)
        dims = [int(d) for d in shape.split("x")]
        if (chip in ("v4", "v5p")) != (len(dims) == 3):
            want = "three dimensions (AxBxC)" if chip in ("v4", "v5p") else "two (AxB)"
            raise ConfigError(f"--topology={name}: a {chip} topology has {want}")
        if nodes != 1:
            raise ConfigError("--nodes is for GPU targets; a TPU target takes --slices")
        return Target(name, "tpu", CHIPS[chip], f"{chip}:{shape}", math.prod(dims), slices)
    m = _TPU_SLICE.match(key)
    if m:
        chip = "v5e" if m.group(1) == "v5litepod" else m.group(1)
        units = int(m.group(2))
        per_chip = _CORES_PER_NAME_UNIT[chip]
        chips = units // per_chip
        shape = SLICE_SHAPES[chip].get(chips)
        if units % per_chip or shape is None:
            known = ", ".join(f"{chip}-{c * per_chip}" for c in SLICE_SHAPES[chip])
            raise ConfigError(f"--topology={name} is not a slice this table knows: use {known}")
        if nodes != 1:
            raise ConfigError("--nodes is for GPU targets; a TPU target takes --slices")
        return Target(name, "tpu", CHIPS[chip], f"{chip}:{shape}", chips, slices)
    m = _GPU_NODE.match(key)
    if m and m.group(1) in CHIPS and CHIPS[m.group(1)].spec_file is not None:
        gpus = int(m.group(2))
        if not 1 <= gpus <= 8 or slices != 1:
            raise ConfigError(f"--topology={name}: 1 to 8 GPUs per node, and --nodes, not --slices")
        chip = CHIPS[m.group(1)]
        return Target(name, "gpu", chip, f"1x{nodes}x{gpus}", gpus, nodes)
    gpus = ", ".join(f"{c}:8" for c, chip in CHIPS.items() if chip.spec_file)
    raise ConfigError(
        f"--topology={name} is not a target: use a TPU topology (v5p:2x2x2, v5e:4x4, v6e:2x4, "
        f"v4:2x2x2), a booked slice (v5p-16, v5e-16, v6e-8, v4-32) or a GPU node ({gpus})"
    )


def _quiet_libtpu() -> None:
    """Environment that keeps libtpu from probing for a TPU VM (metadata server, worker
    hostnames) and lets several planning processes load it at once. Set only where unset."""
    for key, value in (
        ("TPU_SKIP_MDS_QUERY", "1"),
        ("TPU_ACCELERATOR_TYPE", "v5p-8"),  # any valid type: the topology name decides
        ("TPU_WORKER_HOSTNAMES", "localhost"),
        ("TPU_WORKER_ID", "0"),
        ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1"),
    ):
        os.environ.setdefault(key, value)


def target_devices(target: Target) -> list[Any]:
    """The compile-only devices of ``target`` (``jax.experimental.topologies``). ConfigError
    with the install line when the target's compiler is not installed."""
    from jax.experimental import topologies

    try:
        if target.platform == "tpu":
            _quiet_libtpu()
            kwargs: dict[str, Any] = {}
            if target.chip.cores > 1:  # v4 / v5p: one device per chip, both cores
                kwargs["chip_config_name"] = "megacore"
            if target.slices > 1:
                kwargs["num_slices"] = target.slices
            topo = topologies.get_topology_desc(
                topology_name=target.topology, platform="tpu", **kwargs
            )
        else:
            with open(target.spec_path()) as f:
                spec = f.read()
            topo = topologies.get_topology_desc(
                "cuda", "cuda", topology=target.topology, target_config=spec
            )
    except Exception as e:  # the plugin is missing or refuses the topology
        extra = "tpu-plan" if target.platform == "tpu" else "gpu-plan"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"--topology={target.name}: the {target.compiler} compiler is not available "
            f"({first[:200]}); install it with pip install 'jaxrl[{extra}]'"
        ) from None
    devices = list(topo.devices)
    if len(devices) != target.num_devices:
        raise ConfigError(
            f"--topology={target.name}: the compiler gave {len(devices)} devices, the table "
            f"{target.num_devices}"
        )
    return devices


_HBM_MESSAGE = re.compile(r"exceeds available HBM \(([\d.]+)([KMGT])\)|of ([\d.]+)([KMGT]) hbm")
_UNIT = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def hbm_from_message(message: str) -> int | None:
    """The available HBM a libtpu out-of-memory message names, in bytes (its G are GiB)."""
    m = _HBM_MESSAGE.search(message)
    if m is None:
        return None
    value, unit = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
    return int(float(value) * _UNIT[unit])


def tpu_hbm_bytes(device: Any) -> tuple[int, str]:
    """``(bytes, source)``: the HBM one compile-only TPU device may use, as libtpu reports it
    (compiling a program larger than any chip and reading its refusal), else the table's."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh([device], ("x",))
    huge = jax.ShapeDtypeStruct((1 << 40,), jnp.int8, sharding=NamedSharding(mesh, P()))
    try:
        jax.jit(lambda a: a + 1).lower(huge).compile()
    except Exception as e:
        found = hbm_from_message(str(e))
        if found is not None:
            return found, "libtpu (its out-of-memory limit)"
    chip = next(c for c in CHIPS.values() if c.name in str(device.device_kind).lower())
    return chip.hbm_bytes, f"table ({chip.source})"


def gpu_budget_bytes(chip: Chip) -> tuple[int, str]:
    """``(bytes, how)``: what XLA may allocate on a GPU: its memory × the client's preallocated
    fraction (``XLA_PYTHON_CLIENT_MEM_FRACTION``, 0.75 by default) minus the workspace margin."""
    fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", GPU_MEM_FRACTION))
    budget = int(chip.hbm_bytes * fraction) - GPU_WORKSPACE_BYTES
    how = (
        f"{chip.hbm_bytes / GIB:.2f} GiB x XLA_PYTHON_CLIENT_MEM_FRACTION={fraction} - "
        f"{GPU_WORKSPACE_BYTES / GIB:.0f} GiB workspace margin"
    )
    return budget, how


_platform: list[str] = []  # stack of compiling_for() platforms


@contextlib.contextmanager
def compiling_for(platform: str) -> Iterator[None]:
    """Inside the block, jaxrl's backend-dependent choices (the attention kernel of ``auto``,
    the head's chunk, the engine's compiler options) are made for ``platform`` (``"tpu"``,
    ``"gpu"``), not for the backend this process runs on: a target compile's programs are
    those the target would run."""
    _platform.append(platform)
    try:
        yield
    finally:
        _platform.pop()


def target_platform() -> str:
    """The platform programs are built for: the innermost :func:`compiling_for`, else JAX's
    default backend."""
    if _platform:
        return _platform[-1]
    import jax

    return jax.default_backend()
