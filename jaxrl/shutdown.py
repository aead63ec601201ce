"""How the command-line process ends: quietly after a failure, and safely after Ctrl-C.

- A failed orbax restore (e.g. a resume onto a changed model) leaves asyncio tasks behind that
  later call into their closed event loop from background threads. Python prints each as a
  traceback ("Event loop is closed", "Task exception was never retrieved"), dozens of them
  around jaxrl's one-line error. ``quiet_background_errors`` drops exactly those reports
  unless ``--debug`` asks for everything.
- Ctrl-C during an XLA compile raises ``KeyboardInterrupt`` in Python while the compile goes on
  in an XLA thread-pool thread; the interpreter's teardown (jax's ``atexit`` hook clears the
  backends) then frees what that thread still uses, and the process dies by SIGSEGV instead of
  exiting 130. ``exit_now`` ends the process without the teardown: it lets Python's
  non-daemon threads finish (an orbax checkpoint write that already started) as a normal exit
  does, flushes stdio and calls ``os._exit``. Nothing is lost that a normal exit would keep:
  metrics.jsonl and TensorBoard are flushed after every row, and a checkpoint that is not
  committed is never used. (The ``atexit`` hooks are skipped with the teardown: jax's
  clean-up, and a W&B run's ``finish``.)
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any

__all__ = ["exit_now", "is_background_noise", "quiet_background_errors"]

CLOSED_LOOP = "Event loop is closed"
UNRETRIEVED = "exception was never retrieved"  # asyncio: "Task/Future exception was never ..."


def is_background_noise(exc: BaseException | None, message: str = "") -> bool:
    """True for the reports a failed orbax restore leaves: a ``RuntimeError`` about the closed
    event loop, or asyncio's "Task exception was never retrieved"."""
    if UNRETRIEVED in message:
        return True
    return isinstance(exc, RuntimeError) and CLOSED_LOOP in str(exc)


class _AsyncioNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not is_background_noise(exc, str(record.msg))


_FILTER = _AsyncioNoise()


def quiet_background_errors(*, debug: bool = False) -> None:
    """Drop the background reports of ``is_background_noise`` (from ``sys.unraisablehook`` and
    the ``asyncio`` logger) for the rest of the process; with ``debug``, print them again."""
    log = logging.getLogger("asyncio")
    if debug:
        log.removeFilter(_FILTER)
        if getattr(sys.unraisablehook, "_jaxrl_quiet", False):
            sys.unraisablehook = sys.unraisablehook._jaxrl_wrapped  # type: ignore[attr-defined]
        return
    log.addFilter(_FILTER)  # idempotent for one filter object
    if getattr(sys.unraisablehook, "_jaxrl_quiet", False):
        return
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if not is_background_noise(unraisable.exc_value, unraisable.err_msg or ""):
            previous(unraisable)

    hook._jaxrl_quiet = True  # type: ignore[attr-defined]
    hook._jaxrl_wrapped = previous  # type: ignore[attr-defined]
    sys.unraisablehook = hook


def exit_now(code: int) -> None:
    """End the process with ``code`` without interpreter teardown (see the module docstring)."""
    if threading.current_thread() is threading.main_thread():
        threading._shutdown()  # what a normal exit does first: stop executors, join threads
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be said
            pass
    os._exit(code)
