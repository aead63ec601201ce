"""Metrics rows: one JSON object per optimizer step in ``<output_dir>/metrics.jsonl``."""

from __future__ import annotations

import json
import math
import os
from typing import Any

import numpy as np

from jaxrl.runtime import storage


def to_python(metrics: dict[str, Any]) -> dict[str, Any]:
    """Device/numpy scalars → plain floats/ints/bools (NaN stays NaN until written)."""
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        v = np.asarray(value)
        if v.dtype == np.bool_:
            out[key] = bool(v)
        elif np.issubdtype(v.dtype, np.integer):
            out[key] = int(v)
        else:
            out[key] = float(v)
    return out


class MetricsWriter:
    """Append rows to metrics.jsonl (process 0 only); on resume, rows after the restored step
    are discarded.

    That makes an interrupted and resumed run's file identical to an uninterrupted one. With
    ``tensorboard`` and/or a ``wandb`` project the same rows also go to those sinks
    (``jaxrl.train.run_io.log_sinks``), which replay the kept rows when opened.
    """

    def __init__(
        self,
        output_dir: str | os.PathLike,
        *,
        resume_step: int | None = None,
        enabled: bool = True,
        tensorboard: bool = False,
        wandb: str | None = None,
        run_config: dict[str, Any] | None = None,
    ):
        self.path = storage.path(output_dir) / "metrics.jsonl"  # local, or a URL
        self.enabled = enabled  # False on every process but 0: nothing is written
        self.sinks: list[Any] = []
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        rows = read_metrics(self.path) if self.path.exists() else []
        if resume_step is None:
            rows = []
        else:
            rows = [r for r in rows if r.get("step", 0) <= resume_step]
        storage.write_text(self.path, "".join(json.dumps(r) + "\n" for r in rows))
        from jaxrl.train.run_io.log_sinks import TensorBoardSink, WandbSink

        if tensorboard:
            self.sinks.append(TensorBoardSink(self.path.parent / "tensorboard", rows))
        if wandb is not None:
            self.sinks.append(WandbSink(wandb, self.path.parent, run_config or {}, rows))

    def write(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        storage.append_text(self.path, json.dumps(json_safe(row), allow_nan=False) + "\n")
        for sink in self.sinks:
            sink.write(row)

    def close(self) -> None:
        """Flush and close the sinks (metrics.jsonl is complete after every ``write``)."""
        for sink in self.sinks:
            sink.close()
        self.sinks = []


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float (NaN, ±inf) replaced by None, recursively: strict
    JSON (``NaN`` and ``Infinity`` are not JSON, and many readers reject them)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


RUN_DEPENDENT = ("elapsed_s", "compiles", "compile_cache_hits")  # metrics that differ between
# identical runs: timing, the compile count (a resumed process compiles again) and the programs
# the persistent compilation cache supplied; and every "time/..." key


def reproducible(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` without the metrics that differ between two runs of the same config (wall
    times, compile counts): what must be equal when results are."""
    return {k: v for k, v in row.items() if k not in RUN_DEPENDENT and not k.startswith("time/")}


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All rows of a metrics.jsonl file (a local path or a URL)."""
    text = storage.path(path).read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]
