"""JAX's persistent compilation cache, on by default (config key ``compile_cache``).

A compiled XLA program is written to a directory keyed by the program, the jax/XLA version,
the backend and its flags; a later process that compiles the same program reads it back
instead of compiling. So a second run of the same config starts without recompiling its train
step, scorer and sampler programs (docs/performance.md, "Compile once per shape").

``compile_cache``:

- ``true`` (the default): the user cache directory, ``$JAXRL_COMPILE_CACHE`` when set (a path,
  or ``0``/``false``/``off`` to turn the default off: the test suite does), else
  ``$XDG_CACHE_HOME/jaxrl/xla``, else ``~/.cache/jaxrl/xla``;
- a path: that directory;
- ``false``: no persistent cache (every process compiles from scratch).

Hits and misses are counted from jax's monitoring events (:func:`cache_counts`), so a run can
report how many of its programs came from the cache.

Beside the cache, :func:`remember` keeps a small JSON list per program family (e.g. a config's
train step: the batch shapes it compiled for), which a later run reads with
:func:`remembered` to compile those programs ahead, on a background thread, while it starts
(``jaxrl.runtime.background_compile``): the cache skips XLA's compile, this also skips the
tracing and lowering of the first step (docs/performance.md). Nothing is remembered with the
cache off.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import jax

__all__ = ["cache_counts", "default_cache_dir", "enable_compile_cache", "remember", "remembered"]

ENV = "JAXRL_COMPILE_CACHE"
OFF = ("0", "false", "off", "no", "")
MIN_COMPILE_SECONDS = 0.2  # programs that compile faster are not worth a disk entry
SHAPES_DIR = "jaxrl-shapes"  # remembered program shapes, inside the cache directory
MAX_REMEMBERED = 8  # entries kept per family (the most recent)

_counts = {"hits": 0, "misses": 0}
_state: dict[str, object] = {"dir": None, "listening": False}


def default_cache_dir() -> Path | None:
    """Where ``compile_cache: true`` writes: ``$JAXRL_COMPILE_CACHE`` (None when it says off),
    else ``$XDG_CACHE_HOME/jaxrl/xla``, else ``~/.cache/jaxrl/xla``."""
    env = os.environ.get(ENV)
    if env is not None:
        return None if env.strip().lower() in OFF else Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "jaxrl" / "xla"


def _on_event(event: str, **_: object) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _counts["hits"] += 1
    elif event == "/jax/compilation_cache/cache_misses":
        _counts["misses"] += 1


def _enabled() -> bool:
    return bool(jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir)


def enable_compile_cache(setting: bool | str) -> Path | None:
    """Point jax's persistent compilation cache at ``setting``'s directory (module doc), or turn
    it off (``false``); returns the directory in use (None: off). ``true`` with
    ``$JAXRL_COMPILE_CACHE`` off leaves jax's own setting as it is. Idempotent; a new directory
    takes effect for the programs compiled after the call."""
    if not _state["listening"]:  # count hits whoever set the cache up
        jax.monitoring.register_event_listener(_on_event)
        _state["listening"] = True
    if setting is True:
        directory = default_cache_dir()
        if directory is None:  # $JAXRL_COMPILE_CACHE says off: jax's own setting stands
            return _state["dir"]  # type: ignore[return-value]
    else:
        directory = Path(setting) if setting else None
    if directory is not None:
        directory = directory.expanduser().resolve()
    if directory == _state["dir"] and (directory is None) != _enabled():
        return directory
    from jax.experimental.compilation_cache import compilation_cache

    if directory is None:
        jax.config.update("jax_enable_compilation_cache", False)
    else:
        directory.mkdir(parents=True, exist_ok=True)
        jax.config.update("jax_enable_compilation_cache", True)
        jax.config.update("jax_compilation_cache_dir", str(directory))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    compilation_cache.reset_cache()  # the next compile reads the new setting
    _state["dir"] = directory
    return directory


def cache_counts() -> dict[str, int]:
    """Persistent-cache hits and misses of the programs compiled in this process so far."""
    return dict(_counts)


def _shapes_file(family: str) -> Path | None:
    directory = _state["dir"]
    if directory is None or not _enabled():
        return None
    return Path(directory) / SHAPES_DIR / f"{family}.json"  # type: ignore[arg-type]


def remembered(family: str) -> list[Any]:
    """The entries :func:`remember` kept for ``family`` in the cache directory in use (oldest
    first); [] with the cache off, or when none were kept or the file cannot be read."""
    path = _shapes_file(family)
    if path is None or not path.is_file():
        return []
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return entries if isinstance(entries, list) else []


def remember(family: str, entries: list[Any]) -> None:
    """Keep ``entries`` (JSON-able; the last ``MAX_REMEMBERED``) for ``family`` in the cache
    directory in use, written whole or not at all (a temporary file renamed over the old one);
    nothing with the cache off."""
    path = _shapes_file(family)
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
        json.dump(entries[-MAX_REMEMBERED:], f)
    os.replace(f.name, path)
