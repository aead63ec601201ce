"""``DPOConfig``: DPO variants and their step normalisation.

TRL names and defaults (β = 0.1, ``sigmoid``). open-instruct's code defaults differ (β = 5.0,
``dpo_norm``): recipes ported from it must set ``beta`` and ``loss_type`` explicitly. The loss
types and normalisations accepted here are the lists ``jaxrl.losses.dpo`` checks, imported from
``jaxrl.losses.loss_types``.
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
from jaxrl.losses.loss_types import (
    DPO_ALIASES,
    DPO_LOSS_TYPES,
    DPO_MEAN_LOSS_TYPES,
    DPO_NORMALIZE,
    DPO_PAIR_ONLY,
    DPO_REFERENCE_FREE,
    DPO_SMOOTHING_LOSS_TYPES,
)


@removed_fields(**STAGE_SCHEDULE_FIXES)
@dataclasses.dataclass(frozen=True, kw_only=True)
class DPOConfig:
    """DPO / IPO / SimPO / WPO algorithm settings (TRL names where TRL has the concept)."""

    RUN_FIELDS: ClassVar[Mapping[str, str]] = WORLD_SIZE_FROM_MESH  # not config-file keys

    beta: float = 0.1  # β, > 0
    loss_type: str = "sigmoid"  # sigmoid (dpo), sigmoid_norm (dpo_norm), ipo, hinge, robust,
    # simpo, wpo, orpo (NLL + odds ratio, no reference)
    label_smoothing: float = 0.0  # ε in [0, 0.5); only for sigmoid-family, simpo, wpo, robust
    simpo_gamma: float = 0.3  # SimPO margin over β (open-instruct's gamma_beta_ratio)
    normalize: str = "pair"  # pair: Σℓ/N_pairs; token: Σ T_p ℓ_p / Σ T_p
    per_device_train_batch_size: int = 8  # pairs per rank per micro-step
    gradient_accumulation_steps: int = 1  # micro-steps per step; pairs/step = b · g · P
    world_size: int | None = 1  # P: data-parallel size; in a RunConfig its mesh's data × fsdp,
    # None until the run knows it (a mesh axis of -1)
    max_length: int = 1024  # per sequence (prompt + response), applied at tokenisation
    max_prompt_length: int | None = None  # real data: prompt tokens kept (the last); None = all
    precompute_ref_log_probs: bool = True  # the reference cache; False (a frozen reference
    # forward every step, TRL's default) is not implemented: the DPO trainer refuses it
    reference_cache_dir: str | None = None  # None → <output_dir>/ref_cache

    def __post_init__(self) -> None:
        require_choice("loss_type", self.loss_type, DPO_LOSS_TYPES)
        require(self.beta > 0, "beta", self.beta, "use a value > 0")
        require(
            0.0 <= self.label_smoothing < 0.5,
            "label_smoothing",
            self.label_smoothing,
            "use a value in [0, 0.5)",
        )
        require(
            self.label_smoothing == 0.0 or self.loss_type in DPO_SMOOTHING_LOSS_TYPES,
            "label_smoothing",
            self.label_smoothing,
            f"loss_type={self.loss_type!r} has no label smoothing; set label_smoothing=0 or use "
            f"one of {', '.join(map(repr, DPO_SMOOTHING_LOSS_TYPES))}",
        )
        require_choice("normalize", self.normalize, DPO_NORMALIZE)
        require(
            self.normalize == "pair" or self.loss_type not in DPO_PAIR_ONLY,
            "normalize",
            self.normalize,
            f"loss_type={self.loss_type!r} divides its NLL by the step's chosen tokens and its "
            "odds-ratio term by its pairs (docs/losses.md); set normalize=pair",
        )
        require_batch_fields(self)

    @property
    def canonical_loss_type(self) -> str:
        """``dpo`` → ``sigmoid``, ``dpo_norm`` → ``sigmoid_norm``; others unchanged."""
        return DPO_ALIASES.get(self.loss_type, self.loss_type)

    @property
    def uses_mean_logps(self) -> bool:
        """Sequence log-probs are per-token means (else sums) for this loss type."""
        return self.loss_type in DPO_MEAN_LOSS_TYPES

    @property
    def needs_reference(self) -> bool:
        """Every type but ``simpo`` and ``orpo`` needs reference log-probs (no cache is built
        for those)."""
        return self.loss_type not in DPO_REFERENCE_FREE

    @property
    def pairs_per_step(self) -> int:
        """b · g · P pairs per optimizer step (static schedules)."""
        return self.per_device_train_batch_size * self.gradient_accumulation_steps * self.world_size
