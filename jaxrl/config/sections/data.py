"""``task`` and ``data``: the built-in synthetic task, or real data in TRL's formats."""

from __future__ import annotations

import dataclasses
from typing import Literal

from jaxrl.config.base import ConfigError, require

__all__ = ["DataConfig", "TaskConfig"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TaskConfig:
    """A built-in synthetic task (no download)."""

    name: Literal["arithmetic", "calculator"] = "arithmetic"  # arithmetic: a<op>b= answered
    # directly; calculator: answered with a calc tool call (GRPO with grpo.tools, docs/tools.md)
    min_digits: int = 1  # smallest operand width
    max_digits: int = 2  # largest operand width
    ops: str = "+"  # operators to draw from
    reverse_answer: bool = True  # answers least-significant digit first (easier to learn)
    pad_operands: bool = True  # zero-pad operands to max_digits (fixed digit positions)
    train_size: int = 4000  # distinct training problems
    eval_size: int = 200  # distinct held-out problems
    tool_transcripts: float = 0.5  # calculator: fraction of SFT transcripts that call the tool

    def __post_init__(self):
        require(
            1 <= self.min_digits <= self.max_digits,
            "task.min_digits",
            self.min_digits,
            f"use 1 <= min_digits <= max_digits ({self.max_digits})",
        )
        require(self.train_size >= 1, "task.train_size", self.train_size, "use >= 1")
        require(self.eval_size >= 1, "task.eval_size", self.eval_size, "use >= 1")
        t = self.tool_transcripts
        require(0 <= t <= 1, "task.tool_transcripts", t, "use a fraction in [0, 1]")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Real data in TRL's formats (docs/data.md); the alternative to the built-in ``task``.

    Each of ``train``/``eval`` is a local ``.jsonl``/``.json``/``.parquet`` file, a directory
    written by ``datasets``' ``save_to_disk``, or (not a local path) a ``datasets.load_dataset``
    name. The tokenizer (and chat template) comes from ``model.path``.
    """

    train: str | None = None  # training data; None = the built-in task
    eval: str | None = None  # held-out data for eval metrics; None = no evaluation
    split: str = "train"  # split of data.train when it is a DatasetDict directory or a hub name
    eval_split: str = "test"  # split of data.eval when it is a DatasetDict directory or a name

    def __post_init__(self):
        for name in ("train", "eval", "split", "eval_split"):
            value = getattr(self, name)
            require(
                value is None or bool(value.strip()),
                f"data.{name}",
                value,
                "name a file, a save_to_disk directory or a dataset (or leave it out)",
            )
        if self.eval is not None and self.train is None:
            raise ConfigError(
                f"data.eval={self.eval!r} is invalid without data.train: held-out data "
                "evaluates a run on real data; set data.train too (or drop data.eval)"
            )
