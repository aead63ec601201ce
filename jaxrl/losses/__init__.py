"""Loss numerics: ratio-of-sums terms for SFT, the GRPO family and DPO; host advantages.

Names load lazily: ``jaxrl.config`` imports ``jaxrl.losses.loss_types`` (plain Python) and
``jaxrl.losses.advantages`` (numpy) while the CLI reads the config, before jax may be imported
(the CLI sizes the CPU host-device count first). Importing this package pulls in no jax; the
names below import their module on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jaxrl.losses.advantages import aggregate_rewards, compute_advantages, grpo_advantages
    from jaxrl.losses.dpo import dpo_loss
    from jaxrl.losses.normalize import LossTerms, finalize
    from jaxrl.losses.policy import policy_loss_terms

_HOMES = {
    "LossTerms": "normalize",
    "aggregate_rewards": "advantages",
    "compute_advantages": "advantages",
    "dpo_loss": "dpo",
    "finalize": "normalize",
    "grpo_advantages": "advantages",
    "policy_loss_terms": "policy",
}

__all__ = [
    "LossTerms",
    "aggregate_rewards",
    "compute_advantages",
    "dpo_loss",
    "finalize",
    "grpo_advantages",
    "policy_loss_terms",
]


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        value = getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
