"""``jaxrl train CONFIG.yaml [--set key=value ...]`` and ``jaxrl schedule ...``.

Thin: parse, load the config, call the trainer. jax is imported only after the config is read,
so the ``mesh`` section can size the CPU host-device count, and the ``distributed`` section start
a multi-process job, before jax initialises.
"""

from __future__ import annotations

import argparse
import json
import sys


def _train(args: argparse.Namespace) -> int:
    from jaxrl.config import (
        ConfigError,
        DistributedConfig,
        MeshConfig,
        RunConfig,
        apply_overrides,
        from_dict,
        load_yaml,
    )
    from jaxrl.train import launch

    try:
        raw = apply_overrides(load_yaml(args.config), args.set)
        mesh = from_dict(MeshConfig, raw.get("mesh") or {}, where="mesh")
        dist = from_dict(DistributedConfig, raw.get("distributed") or {}, where="distributed")
        if "jax" not in sys.modules:  # before jax initialises: CPU device count, processes
            launch.ensure_host_devices(launch.host_device_count(mesh, dist))
        launch.initialize(dist)
        cfg = from_dict(RunConfig, raw)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    from jaxrl.train.mesh import is_primary
    from jaxrl.trainers import run

    try:
        summary = run(cfg)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if is_primary():
        print(json.dumps(summary, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jaxrl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="run a config (SFT, GRPO or DPO)")
    train.add_argument("config", help="path to a YAML config, e.g. configs/sft_tiny.yaml")
    train.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set mesh.data=8 (repeatable)",
    )
    train.set_defaults(func=_train)
    from jaxrl.data.schedule_report import add_schedule_arguments, run_from_args

    sched = sub.add_parser("schedule", help="show the DP micro-batch plan for a lengths file")
    add_schedule_arguments(sched)
    sched.set_defaults(func=run_from_args)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
