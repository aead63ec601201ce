"""Programs compiled ahead, on one background thread, and waited for by the call that runs them.

A trainer often knows a program's shapes before it needs the program: the first generation's
prompts are known at start, while the held-out evaluation and the first weight copy still run.
``BackgroundCompiles.start(key, compile_fn)`` queues ``compile_fn`` (an ahead-of-time
``jitted.lower(...).compile()``: jit keeps the executable, so the later call with the same
shapes does not trace or compile again) on a daemon thread; ``wait(key)`` blocks the call that
needs it until it is ready. XLA compiles on the calling thread, so the compile overlaps the
foreground's work (benchmarks/README.md, "Real checkpoint": engine programs compiled ahead).

One thread for all of them (every instance queues on it, in order): two compiles at once would
only share the same cores. A compile that fails in the background is dropped without a word:
the foreground call compiles the program itself and raises the real error there.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Hashable

__all__ = ["BackgroundCompiles"]


_QUEUE: queue.SimpleQueue = queue.SimpleQueue()  # (instance, key, compile_fn, done)
_THREAD: list[threading.Thread] = []  # the worker, started by the first ``start``
_THREAD_LOCK = threading.Lock()


class BackgroundCompiles:
    """One owner's compiles (a sampler's, a train step's), queued by key on the shared daemon
    thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[Hashable, threading.Event] = {}
        self._seen: set[Hashable] = set()  # started or waited for: compiled, or compiling
        self.compiled = 0  # background compiles that finished without an error
        self.failed = 0

    def start(self, key: Hashable, compile_fn: Callable[[], object]) -> bool:
        """Queue ``compile_fn`` for ``key``; False (nothing queued) when ``key`` was started or
        waited for before."""
        with self._lock:
            if key in self._seen:
                return False
            self._seen.add(key)
            done = self._pending[key] = threading.Event()
        with _THREAD_LOCK:
            if not _THREAD:
                _THREAD.append(
                    threading.Thread(target=_work, name="jaxrl-background-compile", daemon=True)
                )
                _THREAD[0].start()
        _QUEUE.put((self, key, compile_fn, done))
        return True

    def wait(self, key: Hashable) -> None:
        """Return once ``key``'s background compile (if any) has finished."""
        with self._lock:
            self._seen.add(key)
            done = self._pending.get(key)
        if done is not None:
            done.wait()

    def _run(self, key: Hashable, compile_fn: Callable[[], object], done: threading.Event) -> None:
        try:
            compile_fn()
            self.compiled += 1
        except Exception:  # noqa: BLE001 - the foreground call compiles and raises it
            self.failed += 1
        finally:
            with self._lock:
                self._pending.pop(key, None)
            done.set()


def _work() -> None:
    while True:
        owner, key, compile_fn, done = _QUEUE.get()
        owner._run(key, compile_fn, done)
