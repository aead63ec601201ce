"""Preemption: SIGTERM (a spot / preemptible TPU VM's notice, a maintenance event, Kubernetes
ending a pod) makes the run save a checkpoint at one step every process agrees on and exit with
``PREEMPTED_EXIT`` (docs/troubleshooting.md, "preempted").

The signal handler only sets a flag, so a checkpoint being written when the signal comes is
finished, never cut short (and orbax commits a step only once it is whole: a process killed
outright still leaves the previous checkpoint). At every step boundary each process asks
:meth:`PreemptionWatch.due`: with several processes the flags are combined by one tiny
all-gather (any process's SIGTERM stops every process, so a signal that reached only one host,
or reached hosts at different steps, still yields one step), together with JAX's own
preemption notice where the runtime provides one
(``multihost_utils.reached_preemption_sync_point``, fed by the TPU maintenance-event service).
The session then saves that step and raises :class:`Preempted`; ``jaxrl train`` prints
:func:`preempted_line` and exits with ``PREEMPTED_EXIT``. Running the same command again
resumes from that checkpoint and continues exactly as an uninterrupted run.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

import numpy as np

__all__ = ["PREEMPTED_EXIT", "Preempted", "PreemptionWatch", "preempted_line"]

PREEMPTED_EXIT = 75  # EX_TEMPFAIL: a temporary failure, run the same command again


def preempted_line(step: int) -> str:
    return (
        f"preempted at step {step}, checkpoint saved; run the same command to resume "
        f"(exit code {PREEMPTED_EXIT})"
    )


class Preempted(Exception):  # noqa: N818 - an event, not an error: the run saved and stopped
    """The run stopped at ``step`` after a preemption notice, with a checkpoint at that step."""

    def __init__(self, step: int):
        super().__init__(preempted_line(step))
        self.step = step
        self.exit_code = PREEMPTED_EXIT


class PreemptionWatch:
    """SIGTERM → a flag (in the main thread; elsewhere no handler is installed, and only JAX's
    notice is watched); :meth:`due` at step boundaries; :meth:`close` puts the previous handler
    back."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.requested = True  # acted on at the next step boundary, never mid-save

    def due(self, step: int) -> bool:
        """Whether the run stops after ``step``: the same answer on every process."""
        import jax

        if jax.process_count() == 1:
            return self.requested
        from jax.experimental import multihost_utils

        flag = self.requested or _runtime_notice(step)
        flags = multihost_utils.process_allgather(np.asarray(flag, np.int32))
        self.requested = bool(np.asarray(flags).any())
        return self.requested

    def close(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


def _runtime_notice(step: int) -> bool:
    """JAX's preemption sync point (True at the step every process agrees on after the runtime
    was told of a preemption); False where the runtime has no preemption service."""
    from jax.experimental import multihost_utils

    try:
        return bool(multihost_utils.reached_preemption_sync_point(step))
    except Exception:  # no preemption sync manager in this runtime (e.g. CPU processes)
        return False
