"""``jaxrl schedule``: build the DP schedule of a lengths file in slime and default mode, print a
comparison table (rich) and optionally plot every rank's micro-batches (matplotlib, Agg canvas).

Wiring into a CLI is one line each: ``add_schedule_arguments(subparser)`` and
``run_from_args(args)``; ``main_schedule(argv)`` is a standalone entry point.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from jaxrl.data.batching.schedule import DPSchedule, ScheduleError, build_dp_schedule

__all__ = [
    "DESCRIPTION",
    "MODES",
    "ModeResult",
    "add_schedule_arguments",
    "check_options",
    "compare_schedules",
    "load_lengths",
    "main_schedule",
    "plot_schedule",
    "run_from_args",
    "run_schedule_cli",
    "schedule_figure",
    "stats_table",
]

MAX_LENGTH = 1 << 40  # longer "lengths" are typos (and would overflow the cost sums)
DESCRIPTION = (
    "Build the data-parallel micro-batch schedule of a lengths file in slime mode and in jaxrl's "
    "default mode, print a comparison table and optionally plot every rank's micro-batches."
)
MODES = {
    "slime": {"packing": "first_fit", "balance": "strided"},
    "default": {"packing": "ffd", "balance": "cost"},
}


@dataclass(frozen=True)
class ModeResult:
    """One mode's schedule (or its error) and its build time."""

    mode: str
    schedule: DPSchedule | None
    error: str | None
    seconds: float


def load_lengths(path: str | Path) -> np.ndarray:
    """Sample lengths from a ``.npy`` file or a text file with one integer per line (blank lines
    and ``#`` comments are skipped). Raises ``ValueError`` naming the bad line (or value): a
    length must be a positive integer, and the file must hold at least one."""
    path = Path(path)
    if path.suffix == ".npy":
        try:
            arr = np.load(path, allow_pickle=False)
        except (ValueError, EOFError, OSError) as e:
            if isinstance(e, FileNotFoundError | IsADirectoryError):
                raise
            raise ValueError(f"{path}: not a readable .npy file ({e})") from None
        if not isinstance(arr, np.ndarray) or arr.ndim != 1 or arr.dtype.kind not in "iu":
            what = f"{arr.dtype} {arr.shape}" if isinstance(arr, np.ndarray) else type(arr).__name__
            raise ValueError(f"{path}: expected a 1-D integer array, got {what}")
        bad = np.flatnonzero((arr <= 0) | (arr > MAX_LENGTH))
        if bad.size:
            raise ValueError(
                f"{path}: value {bad[0]} is {arr[bad[0]]}: every length must be a positive "
                f"integer (at most {MAX_LENGTH})"
            )
        values = arr.astype(np.int64)
    else:
        values = []
        for lineno, raw in enumerate(path.read_bytes().split(b"\n"), start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"{path}:{lineno}: not UTF-8 (byte {raw[e.start]:#04x}); write one integer "
                    "per line"
                ) from None
            text = line.split("#", 1)[0].strip()
            if not text:
                continue
            try:
                value = int(text)
            except ValueError:
                raise ValueError(
                    f"{path}:{lineno}: {text[:40]!r} is not an integer length"
                ) from None
            if not 0 < value <= MAX_LENGTH:
                raise ValueError(
                    f"{path}:{lineno}: {text[:40]} is not a length: use a positive integer "
                    f"(at most {MAX_LENGTH})"
                )
            values.append(value)
        values = np.asarray(values, dtype=np.int64)
    if values.size == 0:
        raise ValueError(f"{path}: no lengths (write one positive integer per line)")
    return values


def check_options(
    num_samples: int,
    *,
    dp: int,
    max_tokens: int | None,
    micro_batch_size: int | None,
    rollouts_per_step: int | None,
    micro_batch_group: int,
    step: int,
) -> None:
    """Raise ``ValueError`` naming the first option that no schedule can use."""
    for flag, value in (
        ("--dp", dp),
        ("--max-tokens", max_tokens),
        ("--micro-batch-size", micro_batch_size),
        ("--rollouts-per-step", rollouts_per_step),
        ("--micro-batch-group", micro_batch_group),
    ):
        if value is not None and value < 1:
            raise ValueError(f"{flag}={value} is invalid: use a positive integer")
    if rollouts_per_step is not None and rollouts_per_step > num_samples:
        raise ValueError(
            f"--rollouts-per-step={rollouts_per_step} is invalid: the lengths file holds "
            f"{num_samples} samples, too few for one step; lower it"
        )
    if step < 0:
        raise ValueError(f"--step={step} is invalid: use a step number >= 0")


def check_budget(lengths: np.ndarray, max_tokens: int, *, name: str = "lengths") -> None:
    """Raise ``ScheduleError`` naming the samples longer than ``max_tokens``: a training row
    cannot hold them (slime would give each its own over-budget micro-batch, and the fill
    efficiency of such a plan is meaningless)."""
    over = np.flatnonzero(np.asarray(lengths) > max_tokens)
    if over.size:
        shown = ", ".join(f"sample {i}: {int(lengths[i])} tokens" for i in over[:3])
        more = f" and {over.size - 3} more" if over.size > 3 else ""
        raise ScheduleError(
            f"{name}: {over.size} sample(s) exceed --max-tokens={max_tokens} ({shown}{more}): "
            "a sample must fit one micro-batch; raise --max-tokens or truncate the samples"
        )


def compare_schedules(
    lengths: Sequence[int] | np.ndarray,
    *,
    dp: int,
    max_tokens: int | None = None,
    micro_batch_size: int | None = None,
    modes: Sequence[str] = ("slime", "default"),
    rollouts_per_step: int | None = None,
    micro_batch_group: int = 1,
) -> list[ModeResult]:
    """Build the schedule in each of ``modes``; a ``ScheduleError`` is recorded, not raised."""
    results = []
    for mode in modes:
        start = time.perf_counter()
        try:
            sched = build_dp_schedule(
                lengths,
                dp_size=dp,
                max_tokens=max_tokens,
                micro_batch_size=micro_batch_size,
                rollouts_per_step=rollouts_per_step,
                micro_batch_group=micro_batch_group,
                **MODES[mode],
            )
            error = None
        except ScheduleError as e:
            sched, error = None, str(e)
        results.append(ModeResult(mode, sched, error, time.perf_counter() - start))
    return results


def _summary(s: DPSchedule) -> dict[str, str]:
    steps = [st.stats for st in s.steps]
    per_rank = sorted({st.num_micro_batches for st in steps})
    total_mbs = sum(st.num_micro_batches for st in steps) * s.dp_size
    if s.max_tokens is not None:
        tokens = sum(sum(st.tokens_per_rank) for st in steps)
        fill = tokens / (total_mbs * s.max_tokens)
    else:
        fill = s.num_kept_samples / (total_mbs * (s.micro_batch_size or 1))
    return {
        "steps": str(s.num_steps),
        "micro-batches (all ranks)": str(total_mbs),
        "micro-batches per rank": "/".join(map(str, per_rank)),
        "fill efficiency": f"{fill:.2%}",
        "imbalance (worst step)": f"{max(st.imbalance for st in steps):.2%}",
        "max micro-batch tokens": str(max(st.max_micro_batch_tokens for st in steps)),
        "kept rollouts (samples)": f"{len(s.kept_rollout_ids)} ({s.num_kept_samples})",
        "dropped rollouts (samples)": f"{len(s.dropped_rollout_ids)} ({s.num_dropped_samples})",
        "leftover rollouts (samples)": (
            f"{len(s.leftover_rollout_ids)} ({s.num_leftover_samples})"
        ),
    }


def stats_table(results: Sequence[ModeResult], *, title: str = "DP schedule") -> Table:
    """A rich table with one column per mode. Fill efficiency is token-weighted over all steps
    (sample-weighted in static mode); imbalance is the worst step's."""
    table = Table(title=title)
    table.add_column("")
    for res in results:
        table.add_column(res.mode, justify="right")
    rows = [_summary(r.schedule) if r.schedule is not None else None for r in results]
    keys = next((list(row) for row in rows if row is not None), [])
    for key in keys:
        table.add_row(key, *[row[key] if row is not None else "-" for row in rows])
    if any(row is None for row in rows):
        table.add_row(
            "error", *["" if r.error is None else f"[red]{r.error}[/red]" for r in results]
        )
    table.add_row("build time", *[f"{r.seconds * 1e3:.1f} ms" for r in results])
    return table


def plot_schedule(
    results: Sequence[ModeResult], lengths: np.ndarray, path: str | Path, *, step: int = 0
) -> Path:
    """Save ``schedule_figure`` as a PNG at ``path``."""
    path = Path(path)
    schedule_figure(results, lengths, step=step).savefig(path, format="png", dpi=100)
    return path


def schedule_figure(results: Sequence[ModeResult], lengths: np.ndarray, *, step: int = 0) -> Any:
    """Per mode, each rank's micro-batches of ``step`` as stacked bars of tokens, against the
    rank's budget (micro-batches x max_tokens, dashed); one tick per rank (integer ticks past 32
    ranks). A matplotlib ``Figure`` on an Agg canvas, so the global backend is left alone."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    done = [r for r in results if r.schedule is not None and step < r.schedule.num_steps]
    if not done:
        raise ValueError(f"no schedule with a step {step} to plot")
    fig = Figure(
        figsize=(max(6.0, min(24.0, 0.25 * done[0].schedule.dp_size + 4)), 3.2 * len(done))
    )
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(done), 1, squeeze=False)[:, 0]
    for ax, res in zip(axes, done, strict=True):
        sched = res.schedule
        st = sched.steps[step]
        ranks = np.arange(sched.dp_size)
        bottom = np.zeros(sched.dp_size)
        for m in range(st.num_micro_batches):
            heights = np.array([lengths[mbs[m]].sum() for mbs in st.micro_batches], dtype=float)
            ax.bar(
                ranks,
                heights,
                bottom=bottom,
                width=0.8,
                color=f"C{m % 10}",
                edgecolor="white",
                linewidth=0.3,
            )
            bottom += heights
        title = f"{res.mode} mode ({sched.packing} packing, {sched.balance} balance), step {step}"
        facts = f"fill {st.stats.fill_efficiency:.1%}, imbalance {st.stats.imbalance:.1%}"
        if sched.max_tokens is not None:
            budget = st.num_micro_batches * sched.max_tokens
            ax.hlines(budget, -0.5, sched.dp_size - 0.5, colors="black", linestyles="dashed")
            facts += f", budget (dashed) {st.num_micro_batches} × {sched.max_tokens} tokens"
        ax.set_title(f"{title}\n{facts}", fontsize="medium")  # two short lines fit the width
        ax.set_xlim(-0.5, sched.dp_size - 0.5)
        if sched.dp_size <= 32:
            ax.set_xticks(ranks)
        else:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("data-parallel rank")
        ax.set_ylabel("tokens")
    fig.tight_layout()
    return fig


def run_schedule_cli(
    lengths_file: str | Path,
    dp: int,
    max_tokens: int | None = None,
    mode: str = "both",
    plot: str | Path | None = None,
    *,
    micro_batch_size: int | None = None,
    rollouts_per_step: int | None = None,
    micro_batch_group: int = 1,
    step: int = 0,
    console: Console | None = None,
) -> int:
    """Build, print the comparison table, optionally plot. Returns 0 if every mode succeeded."""
    if mode not in ("slime", "default", "both"):
        raise ValueError(f"mode={mode!r} is not one of 'slime', 'default', 'both'")
    console = console or Console()
    lengths = load_lengths(lengths_file)
    check_options(
        len(lengths),
        dp=dp,
        max_tokens=max_tokens,
        micro_batch_size=micro_batch_size,
        rollouts_per_step=rollouts_per_step,
        micro_batch_group=micro_batch_group,
        step=step,
    )
    if max_tokens is not None:
        check_budget(lengths, max_tokens, name=Path(lengths_file).name)
    modes = ("slime", "default") if mode == "both" else (mode,)
    results = compare_schedules(
        lengths,
        dp=dp,
        max_tokens=max_tokens,
        micro_batch_size=micro_batch_size,
        modes=modes,
        rollouts_per_step=rollouts_per_step,
        micro_batch_group=micro_batch_group,
    )
    budget = f"max_tokens={max_tokens}" if max_tokens else f"micro_batch_size={micro_batch_size}"
    title = f"{len(lengths)} samples from {Path(lengths_file).name}, dp={dp}, {budget}"
    console.print(stats_table(results, title=title))
    if plot is not None and any(r.schedule is not None for r in results):
        console.print(f"plot: {plot_schedule(results, lengths, plot, step=step)}")
    return 0 if all(r.schedule is not None for r in results) else 1


def add_schedule_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``jaxrl schedule`` options to ``parser``."""
    parser.add_argument("--lengths", required=True, help="lengths file: .npy or one int per line")
    parser.add_argument("--dp", type=int, required=True, help="data-parallel size")
    budget = parser.add_mutually_exclusive_group(required=True)
    budget.add_argument("--max-tokens", type=int, help="token budget per micro-batch (dynamic)")
    budget.add_argument("--micro-batch-size", type=int, help="samples per micro-batch (static)")
    parser.add_argument(
        "--mode",
        choices=["slime", "default", "both"],
        default="both",
        help="slime: first-fit packing, bins dealt to ranks in turn (THUDM/slime's schedule); "
        "default: first-fit-decreasing packing, bins balanced by cost (jaxrl's); both "
        "(default): compare them. The default mode usually has the lower imbalance; slime mode "
        "can have the lower one on a step with few micro-batches per rank whose FFD bins are "
        "all nearly full but one small remainder bin, which no assignment can level "
        "(docs/algorithms/schedule.md, 5.2)",
    )
    parser.add_argument("--plot", default=None, help="write a PNG of step --step to this path")
    parser.add_argument("--step", type=int, default=0, help="step to plot (default 0)")
    parser.add_argument(
        "--rollouts-per-step",
        type=int,
        default=None,
        help="samples are single rollouts; default: one step with all of them",
    )
    parser.add_argument(
        "--micro-batch-group",
        type=int,
        default=1,
        help="each rank's micro-batch count is a multiple of this (slime's "
        "microbatch_group_size_per_vp_stage; default 1)",
    )
    return parser


def run_from_args(args: argparse.Namespace) -> int:
    """Run with the options ``add_schedule_arguments`` defined."""
    return run_schedule_cli(
        args.lengths,
        args.dp,
        args.max_tokens,
        args.mode,
        args.plot,
        micro_batch_size=args.micro_batch_size,
        rollouts_per_step=args.rollouts_per_step,
        micro_batch_group=args.micro_batch_group,
        step=args.step,
    )


def main_schedule(argv: Sequence[str] | None = None) -> int:
    """Standalone entry point:
    ``python -m jaxrl.data.batching.schedule_report --lengths F --dp N ...``."""
    parser = add_schedule_arguments(
        argparse.ArgumentParser(prog="jaxrl schedule", description=DESCRIPTION)
    )
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main_schedule())
