"""Loss numerics: ratio-of-sums terms for SFT, the GRPO family and DPO; host advantages."""

from jaxrl.losses.advantages import aggregate_rewards, compute_advantages, grpo_advantages
from jaxrl.losses.dpo import dpo_loss
from jaxrl.losses.normalize import LossTerms, finalize
from jaxrl.losses.policy import policy_loss_terms

__all__ = [
    "LossTerms",
    "aggregate_rewards",
    "compute_advantages",
    "dpo_loss",
    "finalize",
    "grpo_advantages",
    "policy_loss_terms",
]
