"""Run shipped configs on several seeds (and meshes) and print docs/results.md's tables.

    python benchmarks/seed_sweep.py configs/grpo_tiny.yaml --seeds 0 1 2 3 4 --dp8
    python benchmarks/seed_sweep.py configs/sft_tiny.yaml configs/dpo_tiny.yaml

Each run is the plain CLI (``jaxrl train CONFIG --set seed=S --set output_dir=...``) in its own
process (one after another unless ``--jobs``), so every figure is what a user running the
shipped config gets.
Per run it prints the held-out metrics at the start and the end (and the lowest value seen at
any evaluation, for the RL stages); per config, the minimum and median over runs. ``--json``
writes every run's numbers to a file.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# per algorithm: (label, metric key in metrics.jsonl, key of its start value in the summary)
METRICS = {
    "sft": [("exact match", "eval/accuracy", None)],
    "grpo": [
        ("sampled acc.", "eval/accuracy_sampled", "eval/accuracy_sampled_start"),
        ("greedy acc.", "eval/accuracy", "eval/accuracy_start"),
    ],
    "dpo": [
        ("pref. acc.", "eval/accuracy", "eval/accuracy"),
        ("exact match", "eval/exact_match", "eval/exact_match"),
    ],
}


def run_one(config: str, seed: int, extra: list[str], out: Path) -> dict:
    """One CLI run; returns its summary, algorithm, metric rows and wall time."""
    sets = [f"seed={seed}", f"output_dir={out}", "logging.progress=false", *extra]
    cmd = [sys.executable, "-m", "jaxrl.cli", "train", config]
    for s in sets:
        cmd += ["--set", s]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
    summary = json.loads(proc.stdout[proc.stdout.index("{") :])
    cfg = json.loads((out / "config.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"summary": summary, "algorithm": cfg["algorithm"], "rows": rows, "wall_s": wall}


def values(run: dict) -> dict[str, tuple[float | None, float, float]]:
    """Per metric: (start, end, lowest at any evaluation after the start)."""
    out = {}
    s = run["summary"]
    for label, key, start_key in METRICS[run["algorithm"]]:
        seen = [r[key] for r in run["rows"] if r.get(key) is not None and r["step"] > 0]
        if run["algorithm"] == "dpo":
            start = s["start"].get(start_key)
        else:
            start = s.get(start_key) if start_key else None
        out[label] = (start, seen[-1], min(seen))
    return out


def same_global_batch(config: str, ranks: int = 8) -> list[str]:
    """Overrides that keep a config's global batch on ``ranks`` data-parallel ranks: GRPO's and
    DPO's batch sizes are per rank (TRL's per_device_train_batch_size); SFT's is global."""
    from jaxrl.config import load_run_config  # config only: jax is not imported

    cfg = load_run_config(config)
    section = {"grpo": cfg.grpo, "dpo": cfg.dpo}.get(cfg.algorithm)
    if section is None:
        return []
    per_rank, rest = divmod(section.per_device_train_batch_size, ranks)
    if rest:
        raise SystemExit(f"{config}: per_device_train_batch_size does not split over {ranks}")
    return [f"{cfg.algorithm}.per_device_train_batch_size={per_rank}"]


def pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="+")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument(
        "--dp8",
        action="store_true",
        help="also run seed 0 with mesh.data=8 and the same global batch",
    )
    parser.add_argument("--set", action="append", default=[], help="extra --set for every run")
    parser.add_argument("--json", type=Path, help="write every run's numbers here")
    parser.add_argument(
        "--jobs", type=int, default=1, help="runs at once (wall times then include contention)"
    )
    args = parser.parse_args()
    everything = []
    with tempfile.TemporaryDirectory() as tmp:
        for config in args.configs:
            variants = [(seed, "dp=1", []) for seed in args.seeds]
            if args.dp8:
                dp8 = ["mesh.data=8", *same_global_batch(config)]
                variants.append((args.seeds[0], "dp=8", dp8))
            print(f"\n## {config}\n")

            def one(variant, config=config):
                seed, mesh, extra = variant
                out = Path(tmp) / f"{Path(config).stem}_{seed}_{mesh}"
                run = run_one(config, seed, [*extra, *args.set], out)
                run["values"], run["seed"], run["mesh"] = values(run), seed, mesh
                return run

            with ThreadPoolExecutor(args.jobs) as pool:  # each run is its own process
                runs = list(pool.map(one, variants))
            for run in runs:
                seed, mesh = run["seed"], run["mesh"]
                cells = "  ".join(
                    f"{label} {pct(a)} → {pct(b)} (min {pct(c)})"
                    for label, (a, b, c) in run["values"].items()
                )
                print(f"seed {seed} {mesh}: {cells}  [{run['wall_s']:.0f} s]", flush=True)
            labels = list(runs[0]["values"])
            header = "| run | " + " | ".join(f"{x} start → end (min)" for x in labels) + " | wall |"
            print("\n" + header + "\n|" + "---|" * (len(labels) + 2))
            for r in runs:
                cells = " | ".join(
                    f"{pct(a)} → {pct(b)} ({pct(c)})" for a, b, c in r["values"].values()
                )
                print(f"| seed {r['seed']}, {r['mesh']} | {cells} | {r['wall_s']:.0f} s |")
            for name, fn in (("min", min), ("median", statistics.median)):
                cells = []
                for label in labels:
                    starts = [r["values"][label][0] for r in runs]
                    ends = [r["values"][label][1] for r in runs]
                    start = None if None in starts else fn(starts)
                    lows = [r["values"][label][2] for r in runs]
                    cells.append(f"{pct(start)} → {pct(fn(ends))} ({pct(fn(lows))})")
                walls = fn([r["wall_s"] for r in runs])
                print(f"| **{name}** over runs | " + " | ".join(cells) + f" | {walls:.0f} s |")
            everything += [
                {k: r[k] for k in ("seed", "mesh", "values", "wall_s", "summary")}
                | {"config": config}
                for r in runs
            ]
    if args.json:
        args.json.write_text(json.dumps(everything, indent=2, default=str))


if __name__ == "__main__":
    main()
