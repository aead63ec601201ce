"""XLA compile options of the engine's programs (the rollout engine, its sessions, the
sampler's weight copy).

On the CPU backend these programs are compiled at LLVM optimisation level 1
(``xla_backend_optimization_level``) instead of XLA's default 2: their time is in matmul and
attention library calls (YNNPACK / oneDNN), not in the loops LLVM generates, so level 1 runs
them as fast and compiles them sooner (benchmarks/README.md, "Real checkpoint"). The level
changes the last bits of some elementwise math, so the programs whose numbers must equal each
other bit for bit (the train step, the scorer, reference log-probs, and a user's own jitted
forward) keep XLA's default: only the engine, whose
log-probs are compared with the trainer's within a tolerance, takes it. Other backends keep
XLA's defaults. ``JAXRL_CPU_OPT_LEVEL`` overrides the level (e.g. ``2`` for XLA's default).
"""

from __future__ import annotations

import functools
import os
from typing import Any

from jaxrl.runtime.targets import target_platform

__all__ = ["program_options"]

ENV = "JAXRL_CPU_OPT_LEVEL"
CPU_LEVEL = 1


def program_options() -> dict[str, Any]:
    """``compiler_options`` for ``jax.jit`` of an engine program (module doc), for the
    platform programs are built for (``targets.target_platform``: a target compile's)."""
    return _program_options(target_platform())


@functools.cache
def _program_options(platform: str) -> dict[str, Any]:
    if platform != "cpu":
        return {}
    level = os.environ.get(ENV, str(CPU_LEVEL)).strip()
    if level not in ("0", "1", "2", "3"):
        raise ValueError(f"{ENV}={level!r}: must be an LLVM optimisation level 0-3 (default 1)")
    return {"xla_backend_optimization_level": int(level)}


program_options.cache_clear = _program_options.cache_clear  # type: ignore[attr-defined]
