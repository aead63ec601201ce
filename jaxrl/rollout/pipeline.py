"""Asynchronous generation with bounded staleness: GRPO batches made ahead while the trainer trains.

The synchronous loop generates generation m with the weights of the step that loads it into the
buffer, ``load_step(m)`` (version = optimizer updates taken so far; ``MicroStepRule.load_steps``
in ``jaxrl.rollout.buffer``), then trains: a :class:`RolloutPipeline` with ``max_staleness=0``
makes each generation when it is taken. With
``rollout.max_staleness = k >= 1`` the :class:`RolloutPipeline` starts generation m as soon as
the trainer reaches step ``load_step(m) - k``, with that step's weights, on a worker thread (and,
with ``rollout.devices``, on devices of its own), and the trainer takes the finished batch when
it needs it. So a batch trains at most k versions later than the synchronous loop would train it,
never more; generation and training of different steps overlap. Which weights make generation m
is fixed by m alone, not by timing, so a run is reproducible and resumes bit for bit: the
batches generated ahead go into the checkpoint (:meth:`RolloutPipeline.state_dict`).

Host state only: the caller supplies ``produce(params, step)`` (sample, score, build one
:class:`~jaxrl.rollout.rollout_queue.RolloutBatch`) and a snapshot of the weights that the train
step cannot donate away. One worker thread runs the jobs in launch order, so everything a job
advances on the host (the prompt order, the generation counter) advances as in the synchronous
loop. docs/algorithms/async.md has the whole design.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from jaxrl.rollout.rollout_queue import RolloutBatch

__all__ = ["Generated", "RolloutPipeline", "generation_device_count"]


def generation_device_count(max_staleness: int, devices: int, pool: int) -> int:
    """Devices set aside for generation out of a pool of ``pool``: none when synchronous
    (``max_staleness == 0``) or with one device (generation shares it), else ``devices`` or,
    when 0, half of the pool."""
    if max_staleness == 0 or pool == 1:
        return 0
    return devices or pool // 2


@dataclasses.dataclass
class Generated:
    """One generation made by the pipeline."""

    batch: RolloutBatch  # its policy_version: the updates the generating weights had taken
    stats: dict[str, int]  # dynamic-sampling counters of this generation
    seconds: float  # wall time of making it (sample, rewards, old / reference log-probs)
    progress: float | None = None  # the pipeline's progress() right after making it

    def to_json(self) -> dict[str, Any]:
        return {
            "batch": self.batch.to_json(),
            "stats": self.stats,
            "seconds": self.seconds,
            "progress": self.progress,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Generated:
        progress = data.get("progress")  # absent in checkpoints before it was recorded
        return cls(
            RolloutBatch.from_json(data["batch"]),
            {k: int(v) for k, v in data["stats"].items()},
            float(data["seconds"]),
            None if progress is None else float(progress),
        )


Produce = Callable[[Any, int], tuple[RolloutBatch, dict[str, int]]]


class RolloutPipeline:
    """Where every generation comes from: made ahead on a worker thread, at most
    ``max_staleness`` versions early, or with ``max_staleness=0`` made when it is taken (the
    synchronous loop). The one place for generations made ahead: those a checkpoint stored are
    taken first in either mode (an asynchronous run resumed synchronously trains them first).

    ``produce(params, step)`` makes one generation (its batch and dynamic-sampling stats) with
    ``params`` at optimizer step ``step``; ``snapshot()`` returns the weights to make it with: a
    copy that survives the next train steps when asynchronous, the trainer's own when
    synchronous. The trainer calls :meth:`launch_due` at the start of every step and
    :meth:`take` whenever its buffer needs the next generation.

    ``progress()`` (optional) reads host state that the jobs advance, e.g. the passes over
    the prompts: it is read right after each job, in the job's thread, and travels with the
    generation (``Generated.progress``; :meth:`progress_taken`), so the trainer reports the
    value that belongs to the rows it trains rather than whatever jobs made ahead have reached
    by then (timing).
    """

    def __init__(
        self,
        produce: Produce,
        snapshot: Callable[[], Any],
        *,
        max_staleness: int,
        load_steps: Iterator[int],
        max_steps: int,
        progress: Callable[[], float] | None = None,
    ):
        if max_staleness < 0:
            raise ValueError(f"RolloutPipeline: max_staleness={max_staleness} must be >= 0")
        self.produce, self.snapshot = produce, snapshot
        self.k, self.max_steps = max_staleness, max_steps
        self.progress = progress
        self._loads = load_steps
        self._load_of: list[int] = []  # load step of generation m, as far as known
        self.launched = 0  # generations started (or restored) so far
        self.taken = 0  # generations handed to the trainer so far
        self._progress_taken: float | None = None  # progress of the newest one taken
        self._jobs: deque[concurrent.futures.Future[Generated]] = deque()
        self._worker = (
            concurrent.futures.ThreadPoolExecutor(1, "jaxrl-rollout") if max_staleness else None
        )
        self._lock = threading.Lock()
        self._busy_s = 0.0  # worker time spent in jobs since the last metrics()
        self._wait_s = 0.0  # trainer time spent waiting in take() since the last metrics()
        self._since = time.perf_counter()

    def load_step(self, m: int) -> int:
        """The step at which the synchronous loop would load generation ``m``."""
        while len(self._load_of) <= m:
            self._load_of.append(next(self._loads))
        return self._load_of[m]

    def launch_due(self, step: int) -> None:
        """Start every generation the synchronous loop loads by step ``step + k`` (and before
        ``max_steps``) with the weights of step ``step``, one snapshot for all of them."""
        if self._worker is None:  # synchronous: made when taken
            return
        params = None
        while (s := self.load_step(self.launched)) <= step + self.k and s < self.max_steps:
            if params is None:
                params = self.snapshot()
            self._jobs.append(self._worker.submit(self._run, params, step))
            self.launched += 1

    def _run(self, params: Any, step: int) -> Generated:
        start = time.perf_counter()
        batch, stats = self.produce(params, step)
        progress = None if self.progress is None else self.progress()
        seconds = time.perf_counter() - start
        with self._lock:
            self._busy_s += seconds
        return Generated(batch, stats, seconds, progress)

    def take(self, step: int) -> Generated:
        """The next generation (waiting for it if still running; made now when synchronous
        or when nothing was launched); step ``step`` loads it."""
        if not self._jobs and self._worker is None:
            self.launched += 1
            generated = self._run(self.snapshot(), step)
        else:
            if not self._jobs:  # a load the schedule did not predict (rows handed back, ...)
                self._jobs.append(self._worker.submit(self._run, self.snapshot(), step))
                self.launched += 1
            start = time.perf_counter()
            generated = self._jobs.popleft().result()  # a job's exception is raised here
            self._wait_s += time.perf_counter() - start
        self.taken += 1
        if generated.progress is not None:  # None: stored by a checkpoint from before
            self._progress_taken = generated.progress
        return generated

    def progress_taken(self, default: float) -> float:
        """``progress()`` as of the newest generation taken; ``default`` before one was, or
        after resuming a checkpoint that did not record it (a synchronous run's: ``default``
        is then the same value)."""
        return default if self._progress_taken is None else self._progress_taken

    def metrics(self) -> dict[str, float]:
        """Seconds since the last call: ``time/wait_s`` (the trainer waited for a generation)
        and ``time/generator_idle_s`` (the worker had nothing to do); none when synchronous."""
        if self._worker is None:
            return {}
        now = time.perf_counter()
        with self._lock:
            busy, self._busy_s = self._busy_s, 0.0
        wait, self._wait_s = self._wait_s, 0.0
        elapsed, self._since = now - self._since, now
        return {"time/wait_s": wait, "time/generator_idle_s": max(elapsed - busy, 0.0)}

    @property
    def pending(self) -> int:
        """Generations launched (or restored) and not yet taken."""
        return len(self._jobs)

    def state_dict(self) -> dict[str, Any]:
        """JSON: the generations launched and not yet taken (waited for, then stored whole),
        and the counters. Call it only between steps."""
        ready = [job.result() for job in self._jobs]
        return {
            "launched": self.launched,
            "taken": self.taken,
            "ready": [g.to_json() for g in ready],
            "progress_taken": self._progress_taken,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.launched, self.taken = int(state["launched"]), int(state["taken"])
        self._progress_taken = state.get("progress_taken")
        self._jobs.clear()
        for data in state["ready"]:
            done: concurrent.futures.Future[Generated] = concurrent.futures.Future()
            done.set_result(Generated.from_json(data))
            self._jobs.append(done)

    def close(self) -> None:
        """Wait for running jobs, then stop the worker."""
        if self._worker is not None:
            self._worker.shutdown(wait=True, cancel_futures=True)
