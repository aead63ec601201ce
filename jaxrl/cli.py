"""``jaxrl train CONFIG.yaml [--set key=value ...]`` and ``jaxrl schedule ...``.

Thin: parse, load the config, call the trainer. jax is imported only after the config is read,
so ``mesh.data`` can size the CPU host-device count before jax initialises.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys


def _ensure_host_devices(count: int) -> None:
    """Ask XLA for ``count`` CPU devices (no effect on accelerators) unless already set."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" in flags:
        m = re.search(r"xla_force_host_platform_device_count=(\d+)", flags)
        if m and int(m.group(1)) >= count:
            return
        flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", flags)
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


def _train(args: argparse.Namespace) -> int:
    from jaxrl.config import ConfigError, load_run_config

    try:
        cfg = load_run_config(args.config, args.set)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if "jax" not in sys.modules:
        _ensure_host_devices(cfg.mesh.data)
    from jaxrl.trainers import run

    summary = run(cfg)
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
