"""Wall time per GRPO step of a config, for two checkouts side by side (e.g. before/after).

    python benchmarks/grpo_step_bench.py --trees OLD_DIR NEW_DIR [--config configs/grpo_tiny.yaml]
        [--steps 12] [--repeat 2] [--set key=value ...]

Each tree runs ``jaxrl train CONFIG`` in its own process (``PYTHONPATH=<tree>``, the config read
from that tree) without the SFT warm start and held-out sampling, runs alternating between the
trees. A step's time is the difference of consecutive ``elapsed_s`` in metrics.jsonl; the first
step (compiles) and the last (final evaluation) are left out. Prints the median and range per
tree over all runs' steps, and the run's mean completion length (same seed: same prompts).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine  # noqa: E402

BASE = [
    "warm_start.steps=0",
    "logging.eval_every=0",
    "logging.eval_samples=0",
    "logging.progress=false",
    "logging.tensorboard=false",
    "checkpoint.every=0",
]


def run(tree: Path, config: str, steps: int, sets: list[str], out: Path) -> list[dict]:
    args = [sys.executable, "-m", "jaxrl.cli", "train", str(tree / config)]
    for o in [*BASE, f"max_steps={steps}", f"output_dir={out}", *sets]:
        args += ["--set", o]
    env = dict(os.environ, PYTHONPATH=str(tree))
    subprocess.run(args, check=True, cwd=tree, env=env, capture_output=True)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trees", nargs=2, type=Path, required=True)
    ap.add_argument("--config", default="configs/grpo_tiny.yaml")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--set", dest="sets", action="append", default=[])
    args = ap.parse_args()
    print(json.dumps(machine(("jax", "jaxlib"))))
    per_step: dict[str, list[float]] = {str(t): [] for t in args.trees}
    lengths: dict[str, list[float]] = {str(t): [] for t in args.trees}
    root = Path(tempfile.mkdtemp(prefix="grpo_step_bench_"))
    for r in range(args.repeat):
        for i, tree in enumerate(args.trees):
            rows = run(tree.resolve(), args.config, args.steps, args.sets, root / f"{i}_{r}")
            rows = [row for row in rows if "loss" in row]
            t = [row["elapsed_s"] for row in rows]
            per_step[str(tree)] += [b - a for a, b in zip(t[:-1], t[1:], strict=True)][:-1]
            lengths[str(tree)].append(rows[-1]["completions/mean_length"])
    print(f"{args.config} {' '.join(args.sets)}: {args.steps} steps x {args.repeat} runs")
    for tree, ts in per_step.items():
        print(f"| {tree} | {statistics.median(ts):.3f} s/step ({min(ts):.3f}-{max(ts):.3f}) | "
              f"mean length at the last step {lengths[tree]} |")  # fmt: skip
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
