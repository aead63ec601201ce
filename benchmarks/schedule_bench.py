"""Benchmark of ``build_dp_schedule``: build time, fill and balance, slime vs default mode.

Three sections (``--section``, default all):

- ``pod``: the pod-scale sizes of the schedule's time budget, uniform lengths 16..4096 with
  ``max_tokens`` 8192, one step: 8,192 samples on 64 ranks, 32,768 on 256, 100,000 on 1,024.
  Each size and mode is built ``--repeat`` times; min / median / max wall time and the least
  process CPU time are reported (on a shared machine the wall times spread and the CPU time is
  the steadier number). Target for the default mode: 32k x 256 < 0.3 s,
  100k x 1,024 < 1 s.
- ``seeds``: the balance table of docs/algorithms/schedule.md §5.2, ``--seeds`` random draws per
  row (100 by default): mean / max imbalance per mode and in how many draws slime mode balanced
  better. The default mode's swap pass must keep the worst draw of the first row <= 0.2%.
- ``configs``: long-tail RL lengths, fixed seed: lognormal clipped to 50..32768 tokens, either
  "rl" (median 1100, sigma 1.2: mostly short, long tail) or "long" (median 12000, sigma 0.6: long
  responses). Each configuration is built in both modes; the best of ``--repeat`` wall times is
  reported. Every sample is its own rollout; "group" > 1 passes ``group_ids`` (prompt groups of
  that many rollouts).

    python benchmarks/schedule_bench.py                      # every section
    python benchmarks/schedule_bench.py --section pod seeds  # the time budget and the balance
    python benchmarks/schedule_bench.py --quick              # small sizes only

Not a test: it asserts nothing and prints a markdown table for benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import statistics
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
# pod section: (samples, dp); uniform lengths 16..4096, max_tokens 8192, one step
POD = [(8_192, 64), (32_768, 256), (100_000, 1_024)]
POD_LENGTHS, POD_CAP = (16, 4096), 8_192
# seeds section, the rows of docs/algorithms/schedule.md §5.2:
# (label, samples, dp, max_tokens, draw(rng, n) -> lengths)
SEED_ROWS = [
    ("64 uniform in 1..512", 64, 2, 512, lambda rng, n: rng.integers(1, 513, n)),
    ("64 uniform in 1..512", 64, 4, 512, lambda rng, n: rng.integers(1, 513, n)),
    ("256 uniform in 1..512", 256, 8, 512, lambda rng, n: rng.integers(1, 513, n)),
    (
        "1024 lognormal(6.5, 1.0), clipped to 1..4096",
        1024,
        8,
        4096,
        lambda rng, n: np.clip(rng.lognormal(6.5, 1.0, n), 1, 4096).astype(np.int64),
    ),
    ("40 uniform in 1..120", 40, 4, 128, lambda rng, n: rng.integers(1, 121, n)),
    ("4096 uniform in 16..4096", 4096, 32, 8192, lambda rng, n: rng.integers(16, 4097, n)),
]


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


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def pod_section(repeat: int, quick: bool) -> None:
    lo, hi = POD_LENGTHS
    print(f"\n### pod scale: uniform lengths {lo}..{hi}, max_tokens {POD_CAP}, one step\n")
    print(f"<!-- load average (1/5/15 min) before: {load()} -->")
    print(
        "| samples | dp | mode | wall s min | median | max | CPU s min | micro-batches | fill "
        "| imbalance |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n, dp in POD[:2] if quick else POD:
        lengths = np.random.default_rng(0).integers(lo, hi + 1, n)
        for mode in MODES:
            walls, cpus, sched = [], [], None
            for _ in range(repeat):
                cpu = time.process_time()
                seconds, sched = build(lengths, dp, POD_CAP, None, 1, mode, 1)
                cpus.append(time.process_time() - cpu)
                walls.append(seconds)
            assert sched is not None
            mbs, fill, imbalance, _ = summary(sched)
            print(
                f"| {n} | {dp} | {mode} | {min(walls):.3f} | {statistics.median(walls):.3f} | "
                f"{max(walls):.3f} | {min(cpus):.3f} | {mbs} | {fill:.2%} | {imbalance:.5%} |",
                flush=True,
            )
    print(f"<!-- load average after: {load()} -->")


def seeds_section(seeds: int, quick: bool) -> None:
    print(f"\n### balance over {seeds} random draws (mean / max imbalance)\n")
    print(f"<!-- load average before: {load()} -->")
    print("| lengths | dp | max_tokens | default mode | slime mode | slime mode lower |")
    print("|---|---|---|---|---|---|")
    for label, n, dp, cap, draw in SEED_ROWS[:3] if quick else SEED_ROWS:
        imb: dict[str, list[float]] = {mode: [] for mode in MODES}
        for seed in range(seeds):
            lengths = draw(np.random.default_rng(seed), n)
            for mode in MODES:
                imb[mode].append(
                    build(lengths, dp, cap, None, 1, mode, 1)[1].steps[0].stats.imbalance
                )
        ours, theirs = np.array(imb["default"]), np.array(imb["slime"])
        print(
            f"| {label} | {dp} | {cap} | {ours.mean():.3%} / {ours.max():.2%} | "
            f"{theirs.mean():.2%} / {theirs.max():.2%} | {int((theirs < ours).sum())} of {seeds} |",
            flush=True,
        )
    print(f"<!-- load average after: {load()} -->")


def configs_section(repeat: int, quick: bool) -> None:
    print("\n### long-tail RL lengths\n")
    print(f"<!-- load average before: {load()} -->")
    print(
        "| samples | lengths | dp | max_tokens | rollouts/step | group | mode | build s | "
        "micro-batches | fill | imbalance | dropped |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for n, dp, cap, rps, group, dist in QUICK if quick else CONFIGS:
        lengths = long_tail_lengths(n, dist)
        fills = {}
        for mode in MODES:
            seconds, sched = build(lengths, dp, cap, rps, group, mode, repeat)
            mbs, fill, imbalance, dropped = summary(sched)
            fills[mode] = fill
            print(
                f"| {n} | {dist} | {dp} | {cap} | {rps or n} | {group} | {mode} | {seconds:.3f} | "
                f"{mbs} | {fill:.2%} | {imbalance:.1%} | {dropped} |",
                flush=True,
            )
        if fills["default"] < fills["slime"]:
            print(f"<!-- default fill below slime for {(n, dist, dp, cap, rps, group)} -->")
    print(f"<!-- load average after: {load()} -->")


SECTIONS = ("pod", "seeds", "configs")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--section", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--quick", action="store_true", help="small sizes only")
    parser.add_argument("--repeat", type=int, default=5, help="builds per size and mode")
    parser.add_argument("--seeds", type=int, default=100, help="random draws per balance row")
    args = parser.parse_args(argv)
    logging.getLogger("jaxrl.schedule").setLevel(logging.ERROR)
    print(
        f"python {platform.python_version()}, numpy {np.__version__}, {platform.machine()}, "
        f"{len(os.sched_getaffinity(0))} CPUs",
        file=sys.stderr,
    )
    if "pod" in args.section:
        pod_section(args.repeat, args.quick)
    if "seeds" in args.section:
        seeds_section(args.seeds, args.quick)
    if "configs" in args.section:
        configs_section(args.repeat, args.quick)


if __name__ == "__main__":
    main()
