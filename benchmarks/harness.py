"""What the benchmarks share: one fresh-process runner, one call timer and one seconds-per-step
statistic.

``median_call`` times a call (the median of repeats after a warm-up call). ``run_fresh`` runs
one stage of a benchmark in a new interpreter (its own thread pools, its own memory, optionally
pinned to CPUs), with the job written to a JSON file and the stage's output to a log; it
raises SystemExit with the log's tail when the stage fails. ``seconds_per_step`` is the one
s/step every table reports: the median of the steady steps, i.e. of every step after the first
(which compiles or sets up lazily), or the only step of a one-step run.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def median_call(fn: Callable[[], object], repeat: int) -> float:
    """Median seconds of ``repeat`` calls of ``fn`` after one warm-up call (which compiles);
    ``fn`` returns when its work is done (host values, or arrays it waited for)."""
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def seconds_per_step(times: Sequence[float]) -> float | None:
    """Median of the steps after the first (the first compiles), or of the only step."""
    steady = list(times[1:]) or list(times)
    return statistics.median(steady) if steady else None


def run_fresh(
    args: Sequence[str],
    job: dict[str, Any],
    job_file: Path,
    log_file: Path,
    *,
    env: dict[str, str] | None = None,
    cpus: Sequence[int] | None = None,
    timeout: float | None = None,
) -> dict[str, float]:
    """Write ``job`` to ``job_file``, then run ``python ARGS`` in a fresh interpreter with the
    repository on PYTHONPATH, ``env`` added, pinned to ``cpus`` (None: any), output in
    ``log_file``, killed after ``timeout`` seconds (None: no limit). Returns the wall seconds and
    the load average before and after."""
    job_file.parent.mkdir(parents=True, exist_ok=True)
    job_file.write_text(json.dumps(job, indent=1))
    full_env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), full_env.get("PYTHONPATH")]))
    pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    load, t0 = os.getloadavg()[0], time.perf_counter()
    with open(log_file, "w") as log:
        try:
            proc = subprocess.run(
                [sys.executable, *args], stdout=log, stderr=subprocess.STDOUT, env=full_env,
                preexec_fn=pin, timeout=timeout,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            raise SystemExit(
                f"{log_file.stem} timed out after {timeout:.0f} s ({log_file}):\n"
                f"{log_file.read_text()[-4000:]}\ntimed out after {timeout:.0f} s"
            ) from None
    if proc.returncode != 0:
        raise SystemExit(f"{log_file.stem} failed ({log_file}):\n{log_file.read_text()[-4000:]}")
    return {
        "wall_s": time.perf_counter() - t0,
        "load_before": load,
        "load_after": os.getloadavg()[0],
    }
