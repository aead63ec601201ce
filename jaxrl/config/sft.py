"""``SFTConfig``: supervised fine-tuning (``algorithm: sft``, and the ``warm_start`` of the RL
stages)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import ClassVar, Literal

from jaxrl.config.base import (
    STAGE_SCHEDULE_FIXES,
    WORLD_SIZE_FROM_MESH,
    removed_fields,
    require,
    require_choice,
)
from jaxrl.losses.loss_types import SFT_NORMALIZATIONS

BATCH_SIZE_FIX = (
    "removed: it was global (documents per step over all ranks); every section's batch is per "
    "data-parallel rank, as TRL's: set sft.per_device_train_batch_size to batch_size / "
    "(mesh.data × mesh.fsdp), so a step holds per_device_train_batch_size × "
    "gradient_accumulation_steps × ranks documents"
)


@removed_fields(batch_size=BATCH_SIZE_FIX, **STAGE_SCHEDULE_FIXES)
@dataclasses.dataclass(frozen=True, kw_only=True)
class SFTConfig:
    """Cross-entropy on completions. A step holds ``per_device_train_batch_size ×
    gradient_accumulation_steps × world_size`` documents (TRL's meaning; the micro-batches
    themselves are cut by ``schedule.max_tokens``, and the update does not depend on them)."""

    RUN_FIELDS: ClassVar[Mapping[str, str]] = WORLD_SIZE_FROM_MESH  # not config-file keys

    per_device_train_batch_size: int = 8  # b: documents per data-parallel rank per micro-step
    gradient_accumulation_steps: int = 1  # g: micro-steps per step; documents/step = b · g · P
    world_size: int | None = 1  # P: data-parallel size; in a RunConfig its mesh's data × fsdp,
    # None until the run knows it (a mesh axis of -1)
    loss_normalization: Literal["token", "sequence", "document"] = "token"  # step divisor
    completion_only_loss: bool = True  # loss on answer tokens (and EOS) only, not the prompt
    max_length: int = 64  # document length cap (prompt + answer + EOS), in tokens: longer ones
    # keep their first max_length tokens and are counted (data/train_over_length), as in TRL.
    # TRL's default is 1024; 64 fits the built-in tasks (about 12 tokens a document) and the
    # default schedule.max_tokens (512, which it may not exceed); real-data configs set theirs

    def __post_init__(self):
        names = ["per_device_train_batch_size", "gradient_accumulation_steps"]
        if self.world_size is not None:  # a run's section before its mesh is known: None
            names.append("world_size")
        for name in names:
            value = getattr(self, name)
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
            require(ok, f"sft.{name}", value, "use an integer ≥ 1")
        require_choice("sft.loss_normalization", self.loss_normalization, SFT_NORMALIZATIONS)
        require(self.max_length >= 2, "sft.max_length", self.max_length, "use >= 2 tokens")

    @property
    def documents_per_step(self) -> int:
        """b · g · P documents per optimizer step (static steps, ``schedule.docs_per_step: 0``)."""
        if self.world_size is None:
            raise ValueError("documents_per_step needs the world size (RunConfig.with_batch_ranks)")
        return self.per_device_train_batch_size * self.gradient_accumulation_steps * self.world_size
