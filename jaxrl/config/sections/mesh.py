"""``mesh`` and ``distributed``: the device mesh and the multi-process launch
(docs/scale_out.md)."""

from __future__ import annotations

import dataclasses

from jaxrl.config.base import ConfigError, require

__all__ = ["MAX_MESH_DEVICES", "DistributedConfig", "MeshConfig"]

MAX_MESH_DEVICES = 1 << 20  # no machine has more; a larger product is a typo


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """Device mesh ``data × fsdp × tensor``; the product must equal the device count (one axis
    may be -1 = the rest). Batches are split over data × fsdp (the data-parallel ranks);
    parameters and optimizer moments are sharded over fsdp and tensor (docs/scale_out.md)."""

    data: int = -1  # data-parallel ranks (parameters replicated); -1 = the remaining devices
    fsdp: int = 1  # fully sharded data parallel: parameters split, batch split too
    tensor: int = 1  # tensor parallel: heads / MLP / vocabulary split, batch replicated
    expert: int = 1  # expert parallel (MoE models): experts split, batch replicated; no -1
    slices: int = 1  # TPU slices (multislice): only the data axis crosses them (the DCN)

    def __post_init__(self):
        require(
            isinstance(self.slices, int) and not isinstance(self.slices, bool) and self.slices >= 1,
            "mesh.slices",
            self.slices,
            "use the number of TPU slices (1: one slice); the data axis is laid across them",
        )
        require(
            self.data == -1 or self.data % self.slices == 0,
            "mesh.data",
            self.data,
            f"with mesh.slices={self.slices} the data axis crosses the slices, so it must be a "
            f"multiple of {self.slices}",
        )
        require(
            isinstance(self.expert, int) and not isinstance(self.expert, bool) and self.expert >= 1,
            "mesh.expert",
            self.expert,
            "use a positive size (1: no expert axis); it must divide model.num_experts",
        )
        for name in ("data", "fsdp", "tensor"):
            size = getattr(self, name)
            require(
                isinstance(size, int) and (size >= 1 or size == -1),
                f"mesh.{name}",
                size,
                "use a positive size, or -1 for the remaining devices",
            )
        rest = [name for name in ("data", "fsdp", "tensor") if getattr(self, name) == -1]
        require(
            len(rest) <= 1,
            f"mesh.{rest[-1] if rest else 'data'}",
            -1,
            f"only one axis may be -1 (the rest); {', '.join('mesh.' + n for n in rest)} all are",
        )
        product = abs(self.data * self.fsdp * self.tensor * self.expert)
        require(
            product <= MAX_MESH_DEVICES,
            "mesh",
            f"data={self.data} x fsdp={self.fsdp} x tensor={self.tensor}",
            f"{product} devices is more than any machine has (at most {MAX_MESH_DEVICES}); "
            "size the mesh to your devices",
        )

    @property
    def fixed_devices(self) -> int:
        """Devices the axes other than a -1 axis use (the whole count when none is -1)."""
        product = self.data * self.fsdp * self.tensor * self.expert
        return product * (-1 if -1 in self.sizes else 1)

    @property
    def sizes(self) -> tuple[int, int, int]:
        return self.data, self.fsdp, self.tensor

    @property
    def static_batch_ranks(self) -> int | None:
        """Data-parallel ranks ``data × fsdp``; None when an axis is -1 (the run resolves it
        against its devices at start)."""
        return None if -1 in self.sizes else self.data * self.fsdp


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistributedConfig:
    """Multi-process launch (TPU pods, GPU clusters): the arguments of
    ``jax.distributed.initialize``. Every host runs the same ``jaxrl train CONFIG``."""

    coordinator_address: str | None = None  # "host:port" of process 0, reachable by every host
    num_processes: int | None = None  # processes in the job (hosts × processes per host)
    process_id: int | None = None  # this process: 0 .. num_processes - 1
    auto: bool = False  # let JAX detect the cluster (TPU pod, SLURM, Kubernetes, ...)

    def __post_init__(self):
        explicit = {
            "coordinator_address": self.coordinator_address,
            "num_processes": self.num_processes,
            "process_id": self.process_id,
        }
        given = [k for k, v in explicit.items() if v is not None]
        if given and not self.auto and len(given) < 3:
            missing = [k for k in explicit if k not in given]
            raise ConfigError(
                f"distributed.{missing[0]} is missing: with distributed.{given[0]} set, give "
                "coordinator_address, num_processes and process_id (or distributed.auto: true "
                "to let JAX detect them)"
            )
        if self.num_processes is not None:
            require(
                self.num_processes >= 1,
                "distributed.num_processes",
                self.num_processes,
                "use the number of processes in the job (>= 1)",
            )
        if self.process_id is not None:
            bound = self.num_processes
            require(
                self.process_id >= 0 and (bound is None or self.process_id < bound),
                "distributed.process_id",
                self.process_id,
                f"use 0 .. num_processes - 1 ({bound})" if bound else "use an id >= 0",
            )
        if self.coordinator_address is not None:
            require(
                ":" in self.coordinator_address,
                "distributed.coordinator_address",
                self.coordinator_address,
                'use "host:port" of process 0, e.g. "10.0.0.1:1234"',
            )

    @property
    def enabled(self) -> bool:
        return self.auto or self.coordinator_address is not None
