"""How the command-line process ends: quietly after a failure, and safely after Ctrl-C.

- A failed orbax restore (e.g. a resume onto a changed model) leaves asyncio tasks behind that
  later call into their closed event loop from background threads. Python prints each as a
  traceback ("Event loop is closed", "Task exception was never retrieved"), dozens of them
  around jaxrl's one-line error. ``install_hooks`` drops exactly those reports unless
  ``--debug`` asks for everything.
- Ctrl-C that lands while orbax waits for the previous checkpoint write makes orbax log the
  KeyboardInterrupt with its traceback ("Save Finalize thread failed"); ``install_hooks`` drops
  library log records that carry a KeyboardInterrupt (the CLI says "interrupted" once).
- Ctrl-C that arrives while Python runs a gc callback (jax registers one) is reported as
  "Exception ignored" and lost: the run went on to the end. ``install_hooks`` delivers it
  again to the main thread.
- Ctrl-C during an XLA compile raises ``KeyboardInterrupt`` in Python while the compile goes on
  in an XLA thread-pool thread; the interpreter's teardown (jax's ``atexit`` hook clears the
  backends) then frees what that thread still uses, and the process dies by SIGSEGV instead of
  exiting 130. ``exit_now`` flushes stdio and ends the process with ``os._exit``, skipping
  the teardown and the ``atexit`` hooks (jax's clean-up, a W&B run's ``finish``). The run's
  files lose nothing: metrics.jsonl and TensorBoard are flushed after every row, and a
  checkpoint write still in flight is abandoned uncommitted, so the resume uses the previous
  one (orbax commits a step by renaming its directory; tests/test_faults.py kills runs inside
  checkpoint writes). Waiting for that write instead would race the executors that the
  interpreter shuts down ("cannot schedule new futures after interpreter shutdown").
"""

from __future__ import annotations

import _thread
import atexit
import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["exit_now", "install_hooks", "is_background_noise", "on_exit"]

CLOSED_LOOP = "Event loop is closed"
UNRETRIEVED = "exception was never retrieved"  # asyncio: "Task/Future exception was never ..."
REDELIVER_S = 0.05  # a swallowed Ctrl-C is raised again this much later


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


class _InterruptNoise(logging.Filter):
    """Drops a library's report of the Ctrl-C passing through it (orbax logs "Save Finalize
    thread failed" with the KeyboardInterrupt when Ctrl-C lands while a step waits for the
    previous checkpoint write): the CLI reports the interrupt in its one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, KeyboardInterrupt)


_FILTER = _AsyncioNoise()
_INTERRUPT_FILTER = _InterruptNoise()


_STATE = {"debug": False, "redeliver": False}


def install_hooks(*, debug: bool = False, redeliver: bool = False) -> None:
    """For the rest of the process: drop the reports of ``is_background_noise`` (from
    ``sys.unraisablehook`` and the ``asyncio`` logger) unless ``debug``, and with ``redeliver``
    deliver again a Ctrl-C that landed where Python only reports it (a gc callback, a
    ``__del__``). Only a process that is the CLI redelivers: in a host process (a notebook, a
    test runner) a late KeyboardInterrupt would land in whatever runs next."""
    _STATE["debug"] = debug
    _STATE["redeliver"] = redeliver
    log, absl = logging.getLogger("asyncio"), logging.getLogger("absl")
    if debug:
        log.removeFilter(_FILTER)
        absl.removeFilter(_INTERRUPT_FILTER)
    else:
        log.addFilter(_FILTER)  # idempotent for one filter object
        absl.addFilter(_INTERRUPT_FILTER)
    if getattr(sys.unraisablehook, "_jaxrl", False):
        return
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if isinstance(unraisable.exc_value, KeyboardInterrupt) and _STATE["redeliver"]:
            # raised again in the main thread once this callback is over (from another thread:
            # called here, the main thread would raise it inside this hook, and lose it again)
            timer = threading.Timer(REDELIVER_S, _thread.interrupt_main)
            timer.daemon = True
            timer.start()
            return
        noise = is_background_noise(unraisable.exc_value, unraisable.err_msg or "")
        if _STATE["debug"] or not noise:
            previous(unraisable)

    hook._jaxrl = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


_ON_EXIT: dict[int, Callable[[], None]] = {}


def on_exit(callback: Callable[[], None]) -> Callable[[], None]:
    """Run ``callback`` when the process ends, by :func:`exit_now` too (which skips ``atexit``),
    e.g. to stop a server the run started; returns the function that unregisters it."""
    key = id(callback)
    _ON_EXIT[key] = callback
    atexit.register(callback)

    def unregister() -> None:
        _ON_EXIT.pop(key, None)
        atexit.unregister(callback)

    return unregister


def _run_on_exit() -> None:
    for callback in list(_ON_EXIT.values()):
        try:
            callback()
        except Exception:  # noqa: BLE001 - ending anyway; the others still run
            pass


def exit_now(code: int) -> None:
    """End the process with ``code`` without interpreter teardown (see the module docstring),
    after the callbacks of :func:`on_exit`."""
    _run_on_exit()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be said
            pass
    os._exit(code)
