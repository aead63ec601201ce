"""Benchmark of ``build_dp_schedule``: build time and fill efficiency, slime vs default mode.

Long-tail RL lengths, fixed seed: lognormal clipped to 50..32768 tokens, either "rl" (median
1100, sigma 1.2: mostly short, long tail) or "long" (median 12000, sigma 0.6: long responses).
Each configuration is built in slime mode (first-fit + strided) and default mode (FFD + cost
balance); the best of ``--repeat`` wall times is reported. Every sample is its own rollout;
"group" > 1 passes ``group_ids`` (prompt groups of that many rollouts).

    python benchmarks/schedule_bench.py            # all configurations
    python benchmarks/schedule_bench.py --quick    # the small ones only

Not a test: it asserts nothing and prints a markdown table for benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import logging
import platform
import sys
import time

import numpy as np

from jaxrl.data.batching.schedule import DPSchedule, build_dp_schedule

# (samples, dp, max_tokens, rollouts_per_step or None = one step, group size, length distribution)
CONFIGS = [
    (8_192, 8, 32_768, 1_024, 1, "rl"),
    (8_192, 8, 32_768, 1_024, 1, "long"),
    (8_192, 64, 32_768, None, 1, "rl"),
    (8_192, 64, 32_768, 2_048, 8, "rl"),
    (32_768, 16, 32_768, 8_192, 8, "long"),
    (32_768, 128, 32_768, 8_192, 8, "rl"),
    (32_768, 256, 65_536, None, 1, "rl"),
    (100_000, 8, 65_536, 25_000, 1, "long"),
    (100_000, 256, 65_536, None, 1, "rl"),
    (100_000, 1_024, 32_768, None, 1, "rl"),
    (100_000, 1_024, 65_536, None, 1, "rl"),
    (100_000, 1_024, 32_768, None, 1, "long"),
    (100_000, 512, 32_768, 25_000, 8, "rl"),
]
QUICK = CONFIGS[:4]
# lognormal (median, sigma), clipped to 50..32768 tokens
DISTRIBUTIONS = {"rl": (1_100.0, 1.2), "long": (12_000.0, 0.6)}
MODES = {"slime": ("first_fit", "strided"), "default": ("ffd", "cost")}


def long_tail_lengths(n: int, dist: str = "rl", seed: int = 0) -> np.ndarray:
    median, sigma = DISTRIBUTIONS[dist]
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(median), sigma, n), 50, 32_768).astype(np.int64)


def build(
    lengths: np.ndarray, dp: int, cap: int, rps: int | None, group: int, mode: str, repeat: int
) -> tuple[float, DPSchedule]:
    packing, balance = MODES[mode]
    group_ids = np.arange(len(lengths)) // group if group > 1 else None
    best, sched = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        sched = build_dp_schedule(
            lengths,
            dp_size=dp,
            max_tokens=cap,
            rollouts_per_step=rps,
            group_ids=group_ids,
            packing=packing,
            balance=balance,
        )
        best = min(best, time.perf_counter() - start)
    assert sched is not None
    return best, sched


def summary(sched: DPSchedule) -> tuple[int, float, float, int]:
    mbs = sum(st.num_micro_batches for st in sched.steps) * sched.dp_size
    tokens = sum(sum(st.stats.tokens_per_rank) for st in sched.steps)
    fill = tokens / (mbs * sched.max_tokens)
    imbalance = max(st.stats.imbalance for st in sched.steps)
    return mbs, fill, imbalance, sched.num_dropped_samples


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    logging.getLogger("jaxrl.schedule").setLevel(logging.ERROR)
    print(
        f"python {platform.python_version()}, numpy {np.__version__}, {platform.machine()}, "
        f"{platform.processor() or 'cpu'}; best of {args.repeat}",
        file=sys.stderr,
    )
    print(
        "| samples | lengths | dp | max_tokens | rollouts/step | group | mode | build s | "
        "micro-batches | fill | imbalance | dropped |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for n, dp, cap, rps, group, dist in QUICK if args.quick else CONFIGS:
        lengths = long_tail_lengths(n, dist)
        fills = {}
        for mode in MODES:
            seconds, sched = build(lengths, dp, cap, rps, group, mode, args.repeat)
            mbs, fill, imbalance, dropped = summary(sched)
            fills[mode] = fill
            print(
                f"| {n} | {dist} | {dp} | {cap} | {rps or n} | {group} | {mode} | {seconds:.3f} | "
                f"{mbs} | {fill:.2%} | {imbalance:.1%} | {dropped} |",
                flush=True,
            )
        if fills["default"] < fills["slime"]:
            print(f"<!-- default fill below slime for {(n, dist, dp, cap, rps, group)} -->")


if __name__ == "__main__":
    main()
