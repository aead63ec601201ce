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


def join(distributed: Any, mesh: Any) -> None:
    """What a trainer built from Python (a notebook, a script on a pod host) does before it
    touches a device, as ``jaxrl train`` does before it loads jax: start the multi-process job
    the ``distributed`` section describes (``initialize``), or, with no such section, refuse in
    one line a mesh that needs more devices than this process sees (on a pod host each process
    sees only its own chips until the job is joined). Raises ``ConfigError``."""
    import jax
    from jax._src import xla_bridge

    from jaxrl.runtime.errors import ConfigError

    if distributed.enabled:
        if jax.distributed.is_initialized():
            return
        if xla_bridge.backends_are_initialized():
            raise ConfigError(
                "the distributed section asks for a multi-process job, but jax already started "
                "in this process as a single process (something asked for devices or ran a "
                "computation first): build the trainer before any jax computation, or call "
                "jaxrl.runtime.launch.initialize(cfg.distributed) first"
            )
        initialize(distributed)
        return
    if jax.process_count() > 1 or -1 in mesh.sizes:
        return  # a job joined already, or a mesh sized to whatever devices there are
    need, have = mesh.fixed_devices, len(jax.devices())
    if need > have:
        raise ConfigError(
            f"mesh data={mesh.data} x fsdp={mesh.fsdp} x tensor={mesh.tensor} x "
            f"expert={mesh.expert} needs {need} devices but this process sees {have} and the "
            "config has no distributed section: on a TPU pod or GPU cluster set "
            "distributed.auto=true (or coordinator_address, num_processes and process_id) so "
            "every host's process joins one job; on CPU, XLA_FLAGS="
            f"--xla_force_host_platform_device_count={need} before jax starts"
        )
