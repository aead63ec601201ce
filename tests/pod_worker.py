"""One process of a multi-process pod test (``test_pod_launch.py``): ``python
tests/pod_worker.py MODE PROCESS_ID NUM_PROCESSES PORT OUT_DIR [--set key=value ...]``.

MODE ``rewards`` joins the job and scores a generation batch with reward functions that read
their host (``score_once``), computes the advantages, and writes them. MODE ``cli`` starts the
way ``jaxrl train`` does (the CLI's config loader sizes the CPU host
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


def run_workers(mode: str, out: object, count: int = 2, timeout: float = 300) -> None:
    """Run ``count`` processes of this script in ``mode`` as one job (a free coordinator port,
    the repository on PYTHONPATH, each process sizing its own host devices) and wait for all of
    them; every process is killed when one fails or the wait times out. Asserts each exits 0."""
    import subprocess
    from pathlib import Path

    from gcs_emulator import free_port

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    port = free_port()
    args = [str(count), str(port), str(out)]
    procs = [
        subprocess.Popen(
            [sys.executable, "tests/pod_worker.py", mode, str(i), *args],
            cwd=root,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for i in range(count)
    ]
    try:
        for p in procs:
            log = p.communicate(timeout=timeout)[0]
            assert p.returncode == 0, log[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def rewards(pid: str, count: str, port: str, out: str) -> None:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    import numpy as np

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=int(count), process_id=int(pid))
    from jaxrl.losses.advantages import compute_advantages
    from jaxrl.rollout.rewards.compute import score_once

    calls = []

    def host_reward(completions, **kwargs):  # differs per host: must not reach the advantages
        calls.append(len(completions))
        return [float(jax.process_index()) + 0.1 * i for i in range(len(completions))]

    def noisy(completions, **kwargs):  # non-deterministic: a different draw on every host
        return list(np.random.default_rng().normal(size=len(completions)))

    prompts = [f"p{i // 4}" for i in range(8)]  # 2 groups of 4 generations
    got = score_once([host_reward, noisy], prompts, [f"c{i}" for i in range(8)])
    advantages = compute_advantages(got, 4)
    failed = ""
    try:
        score_once([lambda completions, **kw: 1 / 0], prompts, prompts)  # raises on process 0
    except Exception as e:
        failed = f"{type(e).__name__}: {e}"
    result = {
        "rewards": got.tolist(),
        "advantages": np.asarray(advantages).tolist(),
        "calls": calls,
        "failed": failed,
    }
    with open(os.path.join(out, f"rewards_{pid}.json"), "w") as f:
        json.dump(result, f)
    jax.distributed.shutdown()


def main() -> None:
    mode, pid, count, port, out = sys.argv[1:6]
    if mode == "rewards":
        rewards(pid, count, port, out)
        return
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


def length_reward(completions, trainer_state=None, **kwargs):
    """A deterministic reward for the preemption test (``grpo.reward_funcs``), which sends this
    process SIGTERM while step ``$JAXRL_TEST_SIGTERM_AT`` is generated, when that is set (only
    process 0 calls reward functions: the others are not signalled)."""
    import signal

    at = os.environ.get("JAXRL_TEST_SIGTERM_AT")
    if at is not None and trainer_state is not None and trainer_state.global_step + 1 == int(at):
        os.kill(os.getpid(), signal.SIGTERM)
    return [float(len(c) % 3) for c in completions]
