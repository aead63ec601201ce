"""Synchronous vs asynchronous GRPO (``rollout.max_staleness`` 0 vs k) on configs/grpo_tiny.yaml.

    python benchmarks/async_grpo.py --seeds 11 12 13 --devices 8 --staleness 1

Per seed, the synchronous run goes first (its SFT warm start included); the asynchronous run
then starts from a copy of that warm start (``<out>/sft``, so both GRPO stages start from the
same weights) and sets ``rollout.max_staleness``. Both use every one of ``--devices`` CPU host
devices: the synchronous run trains and generates on all of them, the asynchronous one trains on
half and generates on the other half (``rollout.devices`` default), with the same global batch
(``grpo.per_device_train_batch_size`` scaled to the ranks). Each run is the plain CLI in its own
process, one at a time.

``--warm-starts DIR`` reuses the warm starts of an earlier run's folder (printed at its start)
and ``--set max_steps=N`` shortens the GRPO stage, for a timing-only rerun.

Printed per run and summarised over seeds (median, min, max): the GRPO stage's wall time per
step (``stage_wall_s / steps``, evaluations included: the same evaluations in both modes), the
median step time between evaluations (from ``elapsed_s``), the held-out sampled accuracy at the
start and the end of GRPO and its gain, and the asynchronous runs' largest staleness.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from machine import machine  # noqa: E402

CONFIG = "configs/grpo_tiny.yaml"
GLOBAL_BATCH = 256  # grpo_tiny's per_device_train_batch_size on its one device


def run(out: Path, seed: int, ranks: int, devices: int, staleness: int, extra: list[str]) -> dict:
    sets = [
        f"seed={seed}",
        f"output_dir={out}",
        "logging.progress=false",
        "mesh.data=-1",
        f"grpo.per_device_train_batch_size={GLOBAL_BATCH // ranks}",
        f"rollout.max_staleness={staleness}",
        *extra,
    ]
    cmd = [sys.executable, "-m", "jaxrl.cli", "train", CONFIG]
    for s in sets:
        cmd += ["--set", s]
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
    summary = json.loads(proc.stdout[proc.stdout.index("{") :])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    between = [
        b["elapsed_s"] - a["elapsed_s"]
        for a, b in zip(steps[:-1], steps[1:], strict=True)
        if "eval/accuracy" not in b and a["step"] > 1  # no evaluation, no first-step compile
    ]
    return {
        "seed": seed,
        "staleness": staleness,
        "stage_s_per_step": summary["stage_wall_s"] / summary["steps"],
        "median_step_s": statistics.median(between),
        "start": summary["eval/accuracy_sampled_start"],
        "end": summary["eval/accuracy_sampled"],
        "gain": summary["eval/accuracy_sampled"] - summary["eval/accuracy_sampled_start"],
        "max_staleness_seen": max(r.get("rollout/staleness_max", 0) for r in steps),
    }


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} [{min(xs):.3f}, {max(xs):.3f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[11, 12, 13])
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--staleness", type=int, default=1)
    ap.add_argument("--set", action="append", default=[], help="extra --set for both runs")
    ap.add_argument("--json", type=Path, help="write every run's numbers here")
    ap.add_argument(
        "--warm-starts",
        type=Path,
        help="an earlier run's output folder: start both modes from its sync<seed>/sft",
    )
    args = ap.parse_args()
    print(json.dumps(machine(("jax", "jaxlib")), indent=2))
    root = Path(tempfile.mkdtemp(prefix="async_grpo_"))
    print(f"runs in {root}", flush=True)
    results = []
    for seed in args.seeds:
        sync_dir, async_dir = root / f"sync{seed}", root / f"async{seed}"
        if args.warm_starts:
            shutil.copytree(args.warm_starts / f"sync{seed}" / "sft", sync_dir / "sft")
        sync = run(sync_dir, seed, args.devices, args.devices, 0, args.set)
        shutil.copytree(sync_dir / "sft", async_dir / "sft")  # the same warm start
        ranks = args.devices - args.devices // 2
        ahead = run(async_dir, seed, ranks, args.devices, args.staleness, args.set)
        for r in (sync, ahead):
            print(json.dumps(r), flush=True)
        results += [sync, ahead]
    by = {k: [r for r in results if r["staleness"] == k] for k in (0, args.staleness)}
    print("\n| k | GRPO s/step | median step s | sampled acc. start → end | gain | max staleness |")
    print("|---|---|---|---|---|---|")
    for k, rs in by.items():
        print(
            f"| {k} | {spread([r['stage_s_per_step'] for r in rs])} "
            f"| {spread([r['median_step_s'] for r in rs])} "
            f"| {spread([r['start'] for r in rs])} → {spread([r['end'] for r in rs])} "
            f"| {spread([r['gain'] for r in rs])} | {max(r['max_staleness_seen'] for r in rs)} |"
        )
    speed = [
        s["stage_s_per_step"] / a["stage_s_per_step"]
        for s, a in zip(by[0], by[args.staleness], strict=True)
    ]
    step_speed = [
        s["median_step_s"] / a["median_step_s"]
        for s, a in zip(by[0], by[args.staleness], strict=True)
    ]
    print(f"\nspeed-up (sync / async), GRPO s/step: {spread(speed)}")
    print(f"speed-up (sync / async), median step between evaluations: {spread(step_speed)}")
    print(f"load average at the end: {os.getloadavg()}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
