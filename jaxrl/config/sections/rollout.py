"""``rollout``: where and when the GRPO family's rollouts are generated (docs/algorithms/async.md,
docs/rollout.md); ``rollout.vllm`` is ``VLLMConfig``."""

from __future__ import annotations

import dataclasses
from typing import Literal

from jaxrl.config.base import require
from jaxrl.config.sections.vllm import VLLMConfig

__all__ = ["RolloutConfig"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """GRPO generation: where and when rollouts are produced (docs/algorithms/async.md)."""

    max_staleness: int = 0  # policy versions a trained batch may lag its generating weights;
    # 0 = generate, then train (synchronous); k >= 1 = generate ahead while the trainer trains
    devices: int = 0  # devices reserved for generation when max_staleness >= 1 (the last ones);
    # 0 = half of them (none with one device: generation then shares it)
    max_slots: int = 0  # decode slots of the rollout engine (docs/rollout.md): a stopped
    # completion's slot takes the next waiting one; 0 = one slot per completion of the batch
    compact_slots: bool = True  # once every completion has a slot and the live ones fit a half
    # (then a quarter) of the slots, decode on in that many (docs/rollout.md); false = every
    # step runs every slot (shorter compiles)
    tensor_parallel: int = 0  # the sampler's decode layout (docs/scale_out.md): groups of this
    # many devices decode tensor-parallel, the groups data-parallel; 1 = a whole compute-dtype
    # copy per device; 0 = auto: the fewest devices whose share fits weight_budget_gb
    weight_budget_gb: float = 20.0  # auto tensor_parallel: the sampler's weights per device
    scan_layers: bool = False  # with model.scan_layers: the engine decodes in the layer scan
    # (shorter compiles, slower steps); false = unrolled, each layer its own weights
    # (docs/rollout.md)
    backend: Literal["engine", "vllm"] = "engine"  # who generates: jaxrl's engine, or vLLM
    # servers (rollout.vllm; docs/rollout.md)
    sync_every: int = 1  # vllm: send the weights to the servers every k optimizer steps (the
    # samples carry the version they were made with)
    vllm: VLLMConfig = dataclasses.field(default_factory=VLLMConfig)  # backend: vllm's servers

    def __post_init__(self):
        require(
            isinstance(self.sync_every, int) and self.sync_every >= 1,
            "rollout.sync_every",
            self.sync_every,
            "use 1 (every step) or k >= 1 optimizer steps between weight syncs",
        )
        require(
            isinstance(self.max_staleness, int) and self.max_staleness >= 0,
            "rollout.max_staleness",
            self.max_staleness,
            "use 0 (synchronous) or k >= 1 policy versions of lag",
        )
        require(
            isinstance(self.devices, int) and self.devices >= 0,
            "rollout.devices",
            self.devices,
            "use 0 (half of the devices) or the number of devices to generate on",
        )
        require(
            isinstance(self.max_slots, int) and self.max_slots >= 0,
            "rollout.max_slots",
            self.max_slots,
            "use 0 (one slot per completion) or the number of decode slots, e.g. 64",
        )
        require(
            isinstance(self.tensor_parallel, int) and self.tensor_parallel >= 0,
            "rollout.tensor_parallel",
            self.tensor_parallel,
            "use 0 (auto), 1 (a whole copy per device) or a divisor of the generation devices",
        )
        require(
            isinstance(self.compact_slots, bool),
            "rollout.compact_slots",
            self.compact_slots,
            "use true (steps run only the live slots) or false (every slot, shorter compiles)",
        )
        require(
            isinstance(self.scan_layers, bool),
            "rollout.scan_layers",
            self.scan_layers,
            "use false (unrolled: faster decode) or true (one scanned layer: shorter compiles)",
        )
        require(
            isinstance(self.weight_budget_gb, int | float) and self.weight_budget_gb > 0,
            "rollout.weight_budget_gb",
            self.weight_budget_gb,
            "use a positive number of GB, e.g. 20",
        )
