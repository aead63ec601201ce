"""Where metrics rows go besides metrics.jsonl: TensorBoard event files and Weights & Biases
(docs/logging.md).

A sink mirrors metrics.jsonl: it is opened with the rows the file keeps (all of them on a fresh
run: none; on resume: those up to the restored step) and replays them, then receives every new
row. For TensorBoard that means the event files under ``<output_dir>/tensorboard/`` are deleted
and rewritten on every start, so an interrupted and resumed run shows each step once, exactly as
an uninterrupted one (no duplicated or out-of-order steps for TensorBoard to purge). For W&B a
resumed run is a new W&B run whose history starts with the replayed rows.

Every scalar of a row is logged under its own key, at ``step = row["step"]``: numbers as float64
(TensorBoard: a double-precision ``scalars`` summary, as torch's
``add_scalar(double_precision=True)`` writes), booleans as 0/1, NaN and ±inf as they are (where
metrics.jsonl, strict JSON, writes null). None, text, lists and mappings are not scalars and
are left out.
"""

from __future__ import annotations

import numbers
import os
import tempfile
import time
from collections.abc import Iterable
from typing import Any

from jaxrl.runtime import storage

__all__ = ["TensorBoardSink", "WandbSink", "scalars"]

EVENT_GLOB = "events.out.tfevents.*"


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The row's scalars as floats, ``step`` excluded (it is the x axis)."""
    out = {}
    for key, value in row.items():
        if key == "step" or value is None or not isinstance(value, numbers.Real):
            continue
        out[key] = float(value)
    return out


class TensorBoardSink:
    """Event files under ``directory``, rewritten from ``rows`` when opened. For a URL
    (``gs://...``: TensorBoard without TensorFlow writes only local files) they are written in
    a local temporary directory and uploaded after every flush."""

    def __init__(self, directory: str | os.PathLike, rows: Iterable[dict[str, Any]] = ()):
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.directory = storage.path(directory)
        self._remote = storage.is_remote(self.directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        for old in self.directory.glob(EVENT_GLOB):
            old.unlink()
        self._local = tempfile.mkdtemp(prefix="jaxrl-tb-") if self._remote else None
        self._writer = EventFileWriter(self._local or os.fspath(self.directory))
        for row in rows:
            self.write(row, flush=False)
        self._flush()

    def _flush(self) -> None:
        self._writer.flush()
        if self._local is not None:  # one upload per file (each atomic)
            for name, file in storage.files(self._local):
                storage.write_bytes(self.directory / name, file.read_bytes())

    def write(self, row: dict[str, Any], *, flush: bool = True) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2

        plugin = summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars")
        metadata = summary_pb2.SummaryMetadata(plugin_data=plugin)
        values = [
            summary_pb2.Summary.Value(
                tag=tag,
                tensor=tensor_pb2.TensorProto(dtype="DT_DOUBLE", double_val=[value]),
                metadata=metadata,
            )
            for tag, value in scalars(row).items()
        ]
        event = event_pb2.Event(
            wall_time=time.time(), step=int(row["step"]), summary=summary_pb2.Summary(value=values)
        )
        self._writer.add_event(event)
        if flush:  # one row per optimizer step: cheap, and nothing is lost if the run dies
            self._flush()

    def close(self) -> None:
        self._flush()
        self._writer.close()


class WandbSink:
    """A Weights & Biases run in ``project`` (``wandb.init``), fed the replayed and new rows."""

    def __init__(
        self,
        project: str,
        output_dir: str | os.PathLike,
        config: dict[str, Any],
        rows: Iterable[dict[str, Any]] = (),
    ):
        import wandb

        self._wandb = wandb
        # W&B keeps its run files locally (a URL output_dir: the working directory's)
        local = None if storage.is_remote(output_dir) else os.fspath(output_dir)
        self._run = wandb.init(project=project, dir=local, config=config)
        for row in rows:
            self.write(row)

    def write(self, row: dict[str, Any]) -> None:
        self._wandb.log(scalars(row), step=int(row["step"]))

    def close(self) -> None:
        self._wandb.finish()
