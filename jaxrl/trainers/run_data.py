"""A run's datasets: the built-in task's rows or ``data.train`` / ``data.eval``, read alike.

The built-in task (``task`` section) becomes rows in TRL's format for the trainer
(``ArithmeticTask.dataset``); users' data is read by ``jaxrl.data.datasets.read_dataset``.
Both come back as validated ``Dataset``s that ``jaxrl.data.documents`` turns into tokens, so
built-in and real-data runs share one documents path and one length policy (docs/data.md).
"""

from __future__ import annotations

from jaxrl.config import RunConfig
from jaxrl.data.datasets import Dataset, Kind, read_dataset
from jaxrl.train.build import build_task

__all__ = ["run_datasets"]


def run_datasets(cfg: RunConfig, kind: Kind) -> dict[str, Dataset]:
    """``{"train": ..., "eval": ...}`` for a trainer of ``kind``; ``"eval"`` only when the run
    has held-out data (``task.eval_size > 0``, or ``data.eval``)."""
    if cfg.data.train is None:
        task, t = build_task(cfg), cfg.task
        sizes = {"train": t.train_size, "eval": t.eval_size}
        return {split: task.dataset(kind, n, split=split) for split, n in sizes.items() if n}
    data = cfg.data
    sources = {"train": (data.train, data.split), "eval": (data.eval, data.eval_split)}
    return {
        split: read_dataset(source, kind, split=name)
        for split, (source, name) in sources.items()
        if source is not None
    }
