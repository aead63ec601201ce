"""``KTOConfig``: KTO on unpaired examples (TRL ``KTOConfig`` names and defaults).

The loss types are the ones ``jaxrl.losses.kto`` implements (docs/losses.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import ClassVar

from jaxrl.config.base import (
    STAGE_SCHEDULE_FIXES,
    WORLD_SIZE_FROM_MESH,
    removed_fields,
    require,
    require_batch_fields,
    require_choice,
)
from jaxrl.losses.loss_types import KTO_LOSS_TYPES


@removed_fields(**STAGE_SCHEDULE_FIXES)
@dataclasses.dataclass(frozen=True, kw_only=True)
class KTOConfig:
    """KTO / unpaired APO-zero settings (TRL names)."""

    RUN_FIELDS: ClassVar[Mapping[str, str]] = WORLD_SIZE_FROM_MESH  # not config-file keys

    beta: float = 0.1  # β, > 0
    loss_type: str = "kto"  # kto, apo_zero_unpaired
    desirable_weight: float = 1.0  # w_d: weight of a desirable example's loss
    undesirable_weight: float = 1.0  # w_u: weight of an undesirable example's loss
    per_device_train_batch_size: int = 8  # examples per rank per micro-step
    gradient_accumulation_steps: int = 1  # micro-steps per step; examples/step = b · g · P
    world_size: int | None = 1  # P: data-parallel size; in a RunConfig its mesh's data × fsdp
    max_length: int = 1024  # prompt + completion tokens; longer completions are cut
    max_prompt_length: int | None = None  # longer prompts keep their last tokens; None = no cap

    def __post_init__(self) -> None:
        require_choice("loss_type", self.loss_type, KTO_LOSS_TYPES)
        require(self.beta > 0, "beta", self.beta, "use a value > 0")
        for name in ("desirable_weight", "undesirable_weight"):
            value = getattr(self, name)
            require(value > 0, name, value, "use a positive weight (TRL's default is 1.0)")
        require_batch_fields(self)

    @property
    def examples_per_step(self) -> int:
        """b · g · P examples per optimizer step; the KL pairs need at least 2."""
        return self.per_device_train_batch_size * self.gradient_accumulation_steps * self.world_size
