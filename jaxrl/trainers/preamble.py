"""What every trainer does before it trains, written once: the tokenizer, the run's datasets,
the data report and warnings buffered until the session's console exists, the session and its
no-grad scorer.

The datasets are the built-in task's rows or ``data.train`` / ``data.eval``, read alike: the
task (``task`` section) becomes rows in TRL's format (``ArithmeticTask.dataset``); users' data
is read by ``jaxrl.data.datasets.read_dataset``. Both come back as validated ``Dataset``s that
``jaxrl.data.documents`` turns into tokens, so built-in and real-data runs share one documents
path and one length policy (docs/data.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxrl.config import RunConfig
from jaxrl.data.datasets import Dataset, Kind, read_dataset
from jaxrl.data.hub import local_model_dir
from jaxrl.data.tokenizer import TextTokenizer, load_tokenizer
from jaxrl.runtime import storage
from jaxrl.train.build import build_task
from jaxrl.train.objectives import Objective
from jaxrl.train.score import Scorer
from jaxrl.trainers.session import Session

__all__ = ["Preamble", "run_datasets", "run_tokenizer", "with_local_model"]


def with_local_model(cfg: RunConfig) -> RunConfig:
    """``cfg`` with a hub id in ``model.path`` replaced by its local snapshot (downloaded or
    from the cache: ``jaxrl.data.hub``); unchanged for a local path or a fresh model."""
    path = cfg.model.path
    if path is None or (local := local_model_dir(path)) == path:
        return cfg
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=local))


def run_tokenizer(cfg: RunConfig) -> TextTokenizer:
    """``model.path``'s tokenizer (and chat template) for real data, or for the built-in task
    when the model directory has one (e.g. the export of an SFT warm start); else the task's
    character tokenizer."""
    path = cfg.model.path
    if cfg.data.train is not None:
        return load_tokenizer(path)
    if path is not None and (storage.path(path) / "tokenizer.json").is_file():  # or a URL
        return load_tokenizer(path)
    return build_task(cfg).tokenizer()


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


class Preamble:
    """A trainer's start: ``cfg`` (device ranks resolved by the caller; its ``optimizer`` is the
    stage's), the tokenizer, and what reading the data found (``data_report``: rows the length
    limits touched, logged in the first metrics row; ``warnings``: printed by :meth:`session`)."""

    def __init__(self, cfg: RunConfig):
        self.cfg = with_local_model(cfg)
        self.tokenizer = run_tokenizer(self.cfg)
        self.data_report: dict[str, int] = {}
        self.warnings: list[str] = []

    def datasets(self, kind: Kind) -> dict[str, Dataset]:
        return run_datasets(self.cfg, kind)

    def report(self, split: str, report: Any, limit: str) -> None:
        """Record a split's length report (``jaxrl.data.documents``): its metrics, and its
        warning naming ``limit`` if rows were cut."""
        self.data_report.update(report.metrics(split))
        if (line := report.warning(split, limit)) is not None:
            self.warnings.append(line)

    def session(self, objective: Objective) -> Session:
        """The run's session (``build_run``: mesh, model, state, step), the buffered warnings
        printed on its console."""
        session = Session(self.cfg, self.tokenizer.vocab_size, objective)
        session.say(self.warnings)
        return session

    def scorer(self, session: Session, **options: Any) -> Scorer:
        """The no-grad scorer on every device of ``session`` (held-out evaluation, reference
        values, the entropy pre-pass)."""
        chunk = self.cfg.model.logprob_chunk
        return Scorer(session.graphdef, mesh=session.mesh, chunk_size=chunk, **options)
