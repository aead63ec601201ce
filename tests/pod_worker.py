"""One process of a multi-process pod test (``test_pod_launch.py``): ``python
tests/pod_worker.py MODE PROCESS_ID NUM_PROCESSES PORT OUT_DIR [--set key=value ...]``.

MODE ``cli`` starts the way ``jaxrl train`` does (the CLI's config loader sizes the CPU host
devices and calls ``jax.distributed.initialize`` from the ``distributed`` section); ``api`` the
way a script does (jax imported first, the config loaded, a trainer's first step
``with_device_ranks``, which joins the job). Both then build the run's mesh and write what it
is to ``OUT_DIR/<mode>_<id>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

CONFIG = "configs/grpo_tiny.yaml"


def main() -> None:
    mode, pid, count, port, out = sys.argv[1:6]
    sets = [
        "mesh.data=2",
        "mesh.fsdp=2",
        "mesh.tensor=2",
        f"distributed.coordinator_address=127.0.0.1:{port}",
        f"distributed.num_processes={count}",
        f"distributed.process_id={pid}",
    ]
    os.environ["JAX_PLATFORMS"] = "cpu"
    if mode == "cli":
        from jaxrl.cli import _load_config

        cfg = _load_config(argparse.Namespace(config=CONFIG, set=sets))
    else:
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={8 // int(count)}"
        import jax  # noqa: F401  (imported first, as in a notebook: no backend started yet)

        from jaxrl.config import load_run_config
        from jaxrl.trainers.session import with_device_ranks

        cfg = with_device_ranks(load_run_config(CONFIG, sets))
    import jax

    from jaxrl.runtime.mesh import mesh_from_config

    mesh = mesh_from_config(cfg.mesh)
    got = {
        "processes": jax.process_count(),
        "local_devices": len(jax.local_devices()),
        "shape": dict(mesh.shape),
        "devices": [[d.id, d.process_index] for d in mesh.devices.flat],
    }
    with open(os.path.join(out, f"{mode}_{pid}.json"), "w") as f:
        json.dump(got, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
