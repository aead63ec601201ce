"""Calling user code with a deadline: reward functions (``grpo.reward_timeout``), and any later
host-side call that may hang (a tool call, a remote grader).

``call_with_deadline(fn, seconds, name)`` runs ``fn()`` in a worker thread and waits at most
``seconds`` for it; its result or exception comes back as if called directly. When the deadline
passes it raises ``CallTimeoutError``. A Python thread cannot be killed, so the call keeps
running in its (daemon) thread: the caller must stop with the error, not retry, and the process
ends without waiting for the thread. A call that holds the GIL in C code (a tight native loop)
cannot be timed out this way.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["CallTimeoutError", "call_with_deadline"]


class CallTimeoutError(TimeoutError):
    """A call did not return within its deadline; it is still running in a daemon thread."""


def call_with_deadline(fn: Callable[[], T], seconds: float | None, name: str = "call") -> T:
    """``fn()``, or ``CallTimeoutError`` naming ``name`` after ``seconds`` (``None``: no
    deadline, called directly in this thread). Bind arguments with a lambda or ``partial``."""
    if seconds is None:
        return fn()
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the caller, re-raised there
            box["error"] = e

    thread = threading.Thread(target=work, name=f"jaxrl-deadline:{name}", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise CallTimeoutError(
            f"{name} did not return within {seconds:g} s; it keeps running in a background "
            "thread (threads cannot be stopped), so the caller stops here"
        )
    if "error" in box:
        raise box["error"]
    return box["value"]
