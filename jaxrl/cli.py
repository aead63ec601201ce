"""``jaxrl train CONFIG.yaml [--set key=value ...]``, ``jaxrl check CONFIG.yaml``,
``jaxrl memory CONFIG.yaml [--json] [--topology NAME]`` and ``jaxrl schedule ...``.

Thin: parse, load the config, call the trainer. jax is imported only after the config is read,
so the ``mesh`` section can size the CPU host-device count, and the ``distributed`` section start
a multi-process job, before jax initialises.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
from typing import Any


def _load_config(
    args: argparse.Namespace, *, distributed: bool = True, devices: int | None = None
) -> Any:
    """The ``RunConfig`` of ``args.config`` with ``--set`` overrides (``load_run_config``),
    after asking XLA for the CPU host devices the ``mesh`` section needs (before jax
    initialises; no effect on accelerators). ``distributed``: start the multi-process job the
    ``distributed`` section describes (``train``); without it this one process stands in for
    every device of the mesh (``memory``), ``devices`` of them when given (a ``-1`` axis takes
    the rest). Raises ``ConfigError``."""
    from jaxrl.config import DistributedConfig, load_run_config
    from jaxrl.runtime import launch

    def start(mesh: Any, dist: Any) -> None:
        dist = dist if distributed else DistributedConfig()
        if "jax" not in sys.modules:  # before jax initialises: CPU device count, processes
            count = devices or launch.host_device_count(mesh, dist)
            sizes = f"mesh.data={mesh.data} x mesh.fsdp={mesh.fsdp} x mesh.tensor={mesh.tensor}"
            what = f"--devices={devices}" if devices else sizes
            launch.check_host_devices(count, what, computes=distributed)
            launch.ensure_host_devices(count)
        launch.initialize(dist)

    return load_run_config(args.config, args.set, before_build=start)


USAGE_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError)
DEBUG_HINT = "run with --debug (or JAXRL_DEBUG=1) for the traceback"


def _debug(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "debug", False)) or os.environ.get("JAXRL_DEBUG", "") not in ("", "0")


def _fail(e: BaseException, code: int, hint: str = "") -> int:
    """One line (two with a hint) on stderr instead of a traceback."""
    kind = "config error" if type(e).__name__ == "ConfigError" else "error"
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    print(f"{kind}: {first}", file=sys.stderr)
    if hint:
        print(hint, file=sys.stderr)
    return code


def _train(args: argparse.Namespace) -> int:
    """Run a config. Exit 0; 2 for usage errors (config, model directory, data); 1 for runtime
    failures (non-finite training, no usable checkpoint, I/O); 130 on Ctrl-C; 75
    (``PREEMPTED_EXIT``) after a SIGTERM, with a checkpoint saved at the step every process
    stopped at. One line each, no traceback unless ``--debug`` or ``JAXRL_DEBUG=1``."""
    from jaxrl.config import ConfigError

    try:
        cfg = _load_config(args)
    except ConfigError as e:
        return _fail(e, 2)
    from jaxrl.runtime.mesh import is_primary
    from jaxrl.train.run_io.metrics import json_safe
    from jaxrl.train.run_io.preemption import Preempted
    from jaxrl.trainers import run

    hint = DEBUG_HINT
    try:
        summary = run(cfg)
    except Preempted as e:  # SIGTERM: saved at an agreed step (docs/troubleshooting.md)
        print(str(e), file=sys.stderr, flush=True)
        return e.exit_code
    except KeyboardInterrupt:
        print(_interrupted(cfg.output_dir), file=sys.stderr)
        return 130
    except ConfigError as e:  # what a run checks at start (the mesh, the reward functions)
        if _debug(args):
            raise
        return _fail(e, 2)
    except Exception as e:
        if _debug(args):
            raise
        full = _disk_full(e)
        if full is not None:
            return _fail(RuntimeError(_disk_full_message(full, cfg.output_dir)), 1)
        return _fail(e, 2 if isinstance(e, USAGE_ERRORS) else 1, hint)
    if is_primary():
        print(json.dumps(json_safe(summary), indent=2, allow_nan=False))
    return 0


def _check(args: argparse.Namespace) -> int:
    """``jaxrl check``: exit 0 when the step is the same in both layouts, 1 when a quantity
    differs beyond its tolerance (named), 2 for usage errors (``jaxrl.trainers.check``)."""
    import tempfile

    from jaxrl.config import ConfigError

    try:
        cfg = _load_config(args)
    except ConfigError as e:
        return _fail(e, 2)
    import jax

    from jaxrl.config import load_run_config
    from jaxrl.trainers import check

    a_sets, b_sets, line_a, line_b = check.layout_overrides(cfg, jax.device_count())
    with tempfile.TemporaryDirectory(prefix="jaxrl-check-") as tmp:
        try:
            cfg_a, cfg_b = (
                load_run_config(args.config, [*args.set, *sets, f"output_dir={tmp}/{name}"])
                for name, sets in (("a", a_sets), ("b", b_sets))
            )
            a, b = check.two_layouts(cfg_a, cfg_b)
        except (ConfigError, ValueError) as e:
            return _fail(e, 2)
    print(f"jaxrl check {args.config}: one {cfg.algorithm} step in two layouts")
    for tag, line, out in (("A", line_a, a), ("B", line_b, b)):
        print(f"layout {tag}: {line}: {out.row['num_micro_batches']} micro-batches")
    lines, failed = check.verdict_lines(a, b)
    print("\n".join(lines))
    if failed:
        print(
            f"verdict: FAIL: {', '.join(failed)} differ between the layouts: the objective "
            "depends on how the step is cut into micro-batches or spread over devices "
            "(a per-micro-batch or per-device mean, a count taken inside a micro-batch)"
        )
        return 1
    if a.grad_norm == 0 and b.grad_norm == 0:
        print(
            "note: the gradient is 0 in both layouts (e.g. a GRPO generation whose rewards do "
            "not vary within any group), so the parameters were not compared in motion; use a "
            "model that already earns some reward (an SFT warm start) or another seed"
        )
    print("verdict: PASS: the step does not depend on the layout (within tolerance)")
    return 0


def _disk_full(e: BaseException) -> OSError | None:
    """The ENOSPC/EDQUOT ``OSError`` behind ``e`` (libraries such as orbax re-raise it wrapped,
    or as a side effect of a background writer), if any."""
    seen: set[int] = set()
    stack: list[BaseException | None] = [e]
    while stack:
        err = stack.pop()
        if err is None or id(err) in seen:
            continue
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return err
        stack += [err.__cause__, err.__context__, *getattr(err, "exceptions", ())]
    return None


def _disk_full_message(err: OSError, output_dir: str) -> str:
    where = f" writing {err.filename}" if err.filename else ""
    return (
        f"no space left on the disk{where} (output_dir={output_dir}): free space or point "
        "output_dir at another disk, then run again; the last complete checkpoint is kept and "
        "the run resumes from it"
    )


def _interrupted(output_dir: str) -> str:
    """What Ctrl-C leaves behind: the newest committed checkpoint (orbax commits a step by
    renaming its directory to the bare step number) and how to go on."""
    from jaxrl.runtime import storage

    directory = storage.path(output_dir) / "checkpoints"  # a local path or a URL
    names = [p.name for p in directory.iterdir()] if directory.is_dir() else []
    steps = [int(n) for n in names if n.isdigit()]
    if not steps:
        return (
            f"interrupted before the first checkpoint in {directory}: nothing to resume "
            "(checkpoint.every sets how often checkpoints are written)"
        )
    return (
        f"interrupted: the last checkpoint is step {max(steps)} in {directory}; run the same "
        "command again to resume from it"
    )


def _memory(args: argparse.Namespace) -> int:
    from jaxrl.config import ConfigError

    if "jax" not in sys.modules:  # host devices stand in for the target unless told otherwise
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if args.topology is not None:
        return _memory_on_target(args)
    try:
        if args.devices is not None and args.devices < 1:
            raise ConfigError(f"--devices={args.devices} is invalid: use a positive device count")
        cfg = _load_config(args, distributed=False, devices=args.devices)
        if args.budget is not None and args.budget <= 0:
            raise ConfigError(f"--budget={args.budget} is invalid: use the device memory in GB")
        from jaxrl.runtime.compile_cache import enable_compile_cache
        from jaxrl.train.run_io.memory import fit_budget, plan_memory

        enable_compile_cache(cfg.compile_cache)  # a 7B step's plan compiles for minutes
        plan = plan_memory(cfg)
        if args.budget is not None:
            plan.update(fit_budget(cfg, plan, int(args.budget * 1e9)))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan, indent=2))
    else:
        from jaxrl.train.run_io.memory import print_plan

        print_plan(plan, title=args.config)
    return 0


def _memory_on_target(args: argparse.Namespace) -> int:
    """``jaxrl memory --topology NAME``: every program of the run compiled by the target's own
    compiler (``jaxrl.train.run_io.target_plan``). Exit 0 when it fits, 2 with one line when
    it does not (or on a config error), no traceback."""
    from jaxrl.config import ConfigError

    try:
        from jaxrl.runtime.targets import parse_target

        target = parse_target(args.topology, slices=args.slices or 1, nodes=args.nodes)
        if args.devices is not None or args.budget is not None:
            raise ConfigError(
                "--topology sets the devices and their memory: drop --devices, --budget"
            )
        cfg = _load_config(args, distributed=False, devices=target.num_devices)
        if args.slices is None and cfg.mesh.slices > 1:  # the config's multislice job
            target = parse_target(args.topology, slices=cfg.mesh.slices, nodes=args.nodes)
        from jaxrl.train.run_io.target_plan import DoesNotFit, plan_target

        plan = plan_target(cfg, target)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except DoesNotFit as e:
        print(f"{args.topology}: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan, indent=2))
    else:
        from jaxrl.train.run_io.target_plan import print_target_plan

        print_target_plan(plan, title=args.config)
    if not plan["fits"]:
        peak, have = plan["peak_bytes"], plan["device_bytes"]
        print(
            f"{args.topology}: does not fit by {(peak - have) / 2**30:.2f} GiB per device "
            f"({peak / 2**30:.2f} GiB planned, {have / 2**30:.2f} GiB usable); try more "
            "mesh.fsdp, a smaller schedule.max_tokens or a larger target",
            file=sys.stderr,
        )
        return 2
    return 0


def _schedule(args: argparse.Namespace) -> int:
    """``jaxrl schedule``: exit 2 with one line for a bad lengths file or a sample over the
    budget, 1 when a mode cannot align its micro-batches."""
    from jaxrl.data.batching.schedule_report import run_from_args

    try:
        return run_from_args(args)
    except (*USAGE_ERRORS, OSError) as e:  # ScheduleError and UnicodeDecodeError are ValueErrors
        if _debug(args):
            raise
        return _fail(e, 2)


def _add_set(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set mesh.data=8 (repeatable)",
    )


DESCRIPTION = (
    "Exact, layout-invariant RL and preference fine-tuning of language models in JAX. "
    "Commands: train (run a config), check (is its update the same in two layouts?), memory "
    "(plan its per-device memory without allocating), schedule (the data-parallel micro-batch "
    "plan of a lengths file). Algorithms (the config's algorithm: key): sft, dpo (dpo.loss_type "
    "sigmoid, ipo, simpo, ..., or orpo), kto, grpo (GRPO, GSPO, DAPO, Dr.GRPO, CISPO, RLOO: "
    "grpo.loss_type and friends), ppo (GRPO's rollouts with a learned critic)."
)


def _version() -> str:
    """The installed package's version (importlib.metadata)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("jaxrl")
    except PackageNotFoundError:
        return "unknown (not installed)"


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand and return its exit code. With ``argv`` None (this process's own
    command line) a Ctrl-C ends the process at once (``jaxrl.runtime.shutdown.exit_now``)."""
    from jaxrl.runtime.shutdown import exit_now

    try:
        code = _main(argv)
    except KeyboardInterrupt:  # before or after the subcommand's own handling
        print("interrupted", file=sys.stderr)
        code = 130
    if code == 130 and argv is None:
        exit_now(code)
    return code


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="jaxrl", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"jaxrl {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser(
        "train",
        help="run a config: sft, dpo (orpo via dpo.loss_type), kto, grpo or ppo",
        description="Runs the trainer the config's algorithm names (sft, dpo, kto, grpo, ppo; "
        "orpo is dpo.loss_type: orpo; an SFT warm start first when warm_start.steps > 0) and "
        "prints its summary as JSON.",
    )
    train.add_argument("config", help="path to a YAML config, e.g. configs/sft_tiny.yaml")
    _add_set(train)
    train.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    train.set_defaults(func=_train)
    memory = sub.add_parser(
        "memory",
        help="per-device memory of a config's train step, planned without allocating the model",
        description="Per-device bytes of parameters, optimizer state, gradients and the compiled "
        "train step's temporaries, from abstract shapes and an ahead-of-time compile on CPU host "
        "devices standing in for the mesh (set JAX_PLATFORMS to compile for another backend).",
    )
    memory.add_argument("config", help="path to a YAML config, e.g. configs/sft_tiny.yaml")
    _add_set(memory)
    memory.add_argument(
        "--devices",
        type=int,
        default=None,
        metavar="N",
        help="the target's device count, which a mesh axis of -1 fills (default: the product "
        "of the fixed axes)",
    )
    memory.add_argument(
        "--budget",
        type=float,
        default=None,
        metavar="GB",
        help="the device memory in GB (e.g. 80 for an H100, 95 for a TPU v5p chip): says whether "
        "the plan fits and, when not, the largest micro-batch token budget or the fsdp size that "
        "would",
    )
    memory.add_argument(
        "--topology",
        default=None,
        metavar="NAME",
        help="compile every program of the run with the target's own compiler: a TPU topology "
        "(v5p:2x2x2, v5e:4x4), a booked slice (v5p-16, v5e-16, v6e-8, v4-32) or a GPU node "
        "(h100:8, h200:8, b200:8, a100-80g:8); needs jaxrl[tpu-plan] / jaxrl[gpu-plan] "
        "(docs/scale_out.md)",
    )
    memory.add_argument(
        "--slices",
        type=int,
        default=None,
        metavar="N",
        help="TPU slices (multislice, --topology; default: the config's mesh.slices)",
    )
    memory.add_argument(
        "--nodes", type=int, default=1, metavar="N", help="GPU nodes (--topology h100:8 etc.)"
    )
    memory.add_argument("--json", action="store_true", help="print one JSON object")
    memory.set_defaults(func=_memory)
    from jaxrl.data.batching.schedule_report import DESCRIPTION as SCHEDULE
    from jaxrl.data.batching.schedule_report import add_schedule_arguments

    sched = sub.add_parser(
        "schedule", help="show the DP micro-batch plan for a lengths file", description=SCHEDULE
    )
    add_schedule_arguments(sched)
    sched.set_defaults(func=_schedule)
    check = sub.add_parser(
        "check",
        help="one optimizer step in two layouts: is the update independent of the layout?",
        description="Runs the first optimizer step of the config from the same initial weights "
        "in two layouts (as given; and with the data and fsdp sizes swapped and "
        "schedule.max_tokens halved) and prints the relative differences of the loss, the "
        "gradient norm and the updated parameters. Exit 0 when all are within tolerance, 1 "
        "when one is not (the objective depends on the layout), 2 on a usage error.",
    )
    check.add_argument("config", help="path to a YAML config, e.g. configs/dpo_tiny.yaml")
    _add_set(check)
    check.set_defaults(func=_check)
    for sub_parser in (memory, sched, check):
        sub_parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    args = parser.parse_args(argv)
    from jaxrl.runtime.shutdown import install_hooks

    install_hooks(debug=_debug(args), redeliver=argv is None)  # only as the CLI process
    try:
        return int(args.func(args) or 0)
    except Exception as e:  # what the subcommand did not turn into its one line
        if _by_interrupt(e):  # e.g. an import that Ctrl-C broke
            raise KeyboardInterrupt from e
        if _debug(args):
            raise
        return _fail(e, 2 if isinstance(e, USAGE_ERRORS) else 1, DEBUG_HINT)


def _by_interrupt(e: BaseException) -> bool:
    """Whether Ctrl-C is behind ``e`` (its cause or context)."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, KeyboardInterrupt):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


if __name__ == "__main__":
    sys.exit(main())
