"""``SFTConfig``: supervised fine-tuning (the warm start for GRPO and DPO)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from jaxrl.config.base import require, require_choice
from jaxrl.losses.loss_types import SFT_NORMALIZATIONS


@dataclasses.dataclass(frozen=True, kw_only=True)
class SFTConfig:
    """Cross-entropy on completions.

    ``batch_size`` is global (documents per optimizer step over all ranks), not TRL's
    per-device size: a step's data must not change with ``mesh.data``, or the update would.
    """

    batch_size: int = 64  # documents per optimizer step, over all data-parallel ranks
    loss_normalization: Literal["token", "sequence", "document"] = "token"  # step divisor
    completion_only_loss: bool = True  # loss on answer tokens (and EOS) only, not the prompt
    max_length: int = 64  # document length cap (prompt + answer + EOS), in tokens: longer ones
    # keep their first max_length tokens and are counted (data/train_over_length), as in TRL.
    # TRL's default is 1024; 64 fits the built-in tasks (about 12 tokens a document) and the
    # default schedule.max_tokens (512, which it may not exceed); real-data configs set theirs

    def __post_init__(self):
        require(
            self.batch_size >= 1,
            "sft.batch_size",
            self.batch_size,
            "use a positive number of documents per step",
        )
        require_choice("sft.loss_normalization", self.loss_normalization, SFT_NORMALIZATIONS)
        require(self.max_length >= 2, "sft.max_length", self.max_length, "use >= 2 tokens")
