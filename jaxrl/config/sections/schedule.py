"""``schedule``: how an optimizer step's documents become device micro-batches."""

from __future__ import annotations

import dataclasses
from typing import Literal

from jaxrl.config.base import require

__all__ = ["ScheduleConfig"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScheduleConfig:
    """How an optimizer step's documents become device micro-batches."""

    max_tokens: int = 512  # token budget of one micro-batch row (T)
    docs_per_step: int = 0  # global document target per step; 0 = off (static steps)
    packing: Literal["ffd", "first_fit"] = "ffd"  # bin packing of documents into rows
    balance: Literal["cost", "strided", "kk"] = "cost"  # distribution of rows over ranks
    micro_batch_buckets: tuple[int, ...] = ()  # per-rank micro-batch slots M a step may use
    # (one compiled program each; the smallest that holds the step); () = powers of two

    def __post_init__(self):
        require(
            self.max_tokens >= 1,
            "schedule.max_tokens",
            self.max_tokens,
            "use a positive token budget per micro-batch",
        )
        require(
            self.docs_per_step >= 0,
            "schedule.docs_per_step",
            self.docs_per_step,
            "use 0 to turn document-count accumulation off, or a positive target",
        )
        require(
            all(k >= 1 for k in self.micro_batch_buckets),
            "schedule.micro_batch_buckets",
            self.micro_batch_buckets,
            "use positive bucket sizes",
        )
