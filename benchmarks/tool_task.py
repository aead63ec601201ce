"""``configs/grpo_tools_tiny.yaml`` on several seeds: does GRPO raise held-out accuracy and the
tool-call rate of the calculator task (docs/tools.md)? Prints the table in benchmarks/README.md.

    python benchmarks/tool_task.py --seeds 1 2 3 [--json out.json] [--set key=value ...]

Each run is the plain CLI in its own process, one after another. Per run: held-out greedy and
sampled accuracy and tool-call rate at the start of GRPO (after the SFT warm start) and at the
end, and the training episodes' tool-call rate over the first and last 5 steps; then the
minimum, median and maximum over seeds. The config was tuned on seed 0; report other seeds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIG = "configs/grpo_tools_tiny.yaml"
EVAL = [
    ("greedy acc.", "eval/accuracy"),
    ("sampled acc.", "eval/accuracy_sampled"),
    ("greedy call rate", "eval/tool_call_rate"),
    ("sampled call rate", "eval/tool_call_rate_sampled"),
]


def run(seed: int, out: Path, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "jaxrl.cli", "train", CONFIG]
    for s in (f"seed={seed}", f"output_dir={out}", "logging.progress=false", *extra):
        cmd += ["--set", s]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
    summary = json.loads(proc.stdout[proc.stdout.index("{") :])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    calls = [r["tools/call_rate"] for r in rows if "tools/call_rate" in r]
    result = {"seed": seed, "wall_s": round(time.perf_counter() - t0, 1)}
    for label, key in EVAL:
        result[label] = (summary.get(f"{key}_start"), summary.get(key))
    result["train call rate"] = (statistics.mean(calls[:5]), statistics.mean(calls[-5:]))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--set", action="append", default=[], dest="sets")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            results.append(run(seed, Path(tmp) / f"seed{seed}", args.sets))
            print(json.dumps(results[-1]), flush=True)
    labels = [label for label, _ in EVAL] + ["train call rate"]
    print("\n| seed | " + " | ".join(labels) + " | wall s |")
    print("|---" * (len(labels) + 2) + "|")
    fmt = lambda p: f"{p[0]:.2f} → {p[1]:.2f}"  # noqa: E731
    for r in results:
        print(f"| {r['seed']} | " + " | ".join(fmt(r[k]) for k in labels) + f" | {r['wall_s']} |")
    for name, agg in (("min", min), ("median", statistics.median), ("max", max)):
        cells = [f"{agg(r[k][0] for r in results):.2f} → {agg(r[k][1] for r in results):.2f}"
                 for k in labels]  # fmt: skip
        print(f"| {name} | " + " | ".join(cells) + " | |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
