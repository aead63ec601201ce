"""Process start-up before jax touches a device: host device count on CPU, multi-process init.

Every host of a TPU pod or GPU cluster runs the same ``jaxrl train CONFIG``; the ``distributed``
section (or ``distributed.auto``) makes them one JAX job via ``jax.distributed.initialize``.
On CPU the processes talk over gloo (``jax_cpu_collectives_implementation``), which is how the
test suite runs two processes × 4 host devices.
"""

from __future__ import annotations

import os
import re
from typing import Any

# CPU host devices one process may ask XLA for: each costs about 0.1 MB of host memory and a
# thread before any model exists (4096 take ~0.6 GB and seconds to create; 100000 grew past
# 4 GB and crashed XLA), and every replicated array is stored once per device.
MAX_HOST_DEVICES = 4096
HOST_DEVICE_MB = 0.1
# XLA's CPU backend runs one computation over at most this many devices of one process: with
# more (e.g. mesh.data=4096) the first step dies inside XLA with "Multiprocess computations
# aren't implemented on the CPU backend" (measured with jax 0.10.2: 2048 run, 2049 fail).
# Planning (``jaxrl memory --devices``) runs no computation, so it may ask for more.
MAX_CPU_COMPUTATION_DEVICES = 2048


def check_host_devices(count: int, what: str, *, computes: bool = False) -> None:
    """Raise ``ConfigError`` naming ``what`` (the setting that asks) when ``count`` CPU host
    devices are more than ``MAX_HOST_DEVICES`` (``computes``: more than one process's CPU
    computation can span, ``MAX_CPU_COMPUTATION_DEVICES``); call it before jax initialises."""
    limit = MAX_CPU_COMPUTATION_DEVICES if computes else MAX_HOST_DEVICES
    if count > limit:
        from jaxrl.runtime.errors import ConfigError

        need = count * HOST_DEVICE_MB / 1024
        why = "XLA's CPU backend runs one computation over" if computes else "allowed"
        raise ConfigError(
            f"{what} asks for {count} CPU host devices in one process, more than the "
            f"{limit} {why} (each takes about {HOST_DEVICE_MB:g} MB of host memory "
            f"and holds its own copy of every replicated array: over {need:.1f} GB before the "
            "model); size the mesh to the devices you have, or spread it over processes "
            "(the distributed section)"
        )


def ensure_host_devices(count: int) -> None:
    """Ask XLA for ``count`` CPU devices (no effect on accelerators) unless at least that many
    are already requested. Must run before jax initialises its backends."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" in flags:
        m = re.search(r"xla_force_host_platform_device_count=(\d+)", flags)
        if m and int(m.group(1)) >= count:
            return
        flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", flags)
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


def host_device_count(mesh: Any, distributed: Any) -> int:
    """CPU devices per process that a mesh section needs: its fixed axes' product (a -1 axis
    counts as 1), split evenly over the configured processes."""
    processes = distributed.num_processes or 1
    return max(1, -(-mesh.fixed_devices // processes))


def initialize(distributed: Any) -> None:
    """``jax.distributed.initialize`` from a ``distributed`` section (no-op when it is off or
    already done). Call before anything queries devices."""
    import jax

    if not distributed.enabled or jax.distributed.is_initialized():
        return
    if os.environ.get("JAX_CPU_COLLECTIVES_IMPLEMENTATION") is None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU only; else unused
    kwargs = {
        name: getattr(distributed, name)
        for name in ("coordinator_address", "num_processes", "process_id")
        if getattr(distributed, name) is not None
    }
    jax.distributed.initialize(**kwargs)
