"""Loss-type names: the one list the loss functions and the configs both check against.

No jax here on purpose: ``jaxrl.config`` validates against these names, and the CLI reads the
config before jax is imported, so that ``mesh.data`` can still size the CPU host-device count.

GRPO family (``GRPOConfig.loss_type``): each type is a normalisation mode of
``jaxrl.losses.normalize``, which turns the per-token losses into the step's numerator and
denominator (see the table there).
"""

from __future__ import annotations

# loss_type → normalize mode. Order is the order error messages list the choices in.
GRPO_LOSS_MODES: dict[str, str] = {
    "grpo": "sequence",  # per-document token mean, averaged over documents (TRL grpo)
    "bnpo": "token",  # token mean over the whole step (TRL bnpo)
    "dr_grpo": "constant",  # token sum over documents × max_completion_length (Dr.GRPO)
    "dapo": "token",  # token mean over the whole step (TRL dapo)
    "seq_mean_token_sum": "document",  # token sum over documents (Fast-LLM GSPO)
    "cispo": "token",  # clipped IS weight, token mean over the whole step (MiniMax-M1; TRL cispo)
}
GRPO_LOSS_TYPES = tuple(GRPO_LOSS_MODES)
# Types whose numerator sums tokens with a step-wide denominator, so sequence-level importance
# sampling weights each sequence by its length (TRL #3823, #6042): the config warns.
TOKEN_SUMMING_LOSS_TYPES = ("bnpo", "dr_grpo", "dapo", "cispo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
# Off-policy correction of the sampler/trainer gap (``jaxrl.losses.sampler_correction``).
CORRECTION_MODES = (
    "token_truncate",
    "token_mask",
    "sequence_truncate",
    "sequence_mask",
    "sequence_geo_mask",
)

# SFT (``SFTConfig.loss_normalization``): normalize modes a cross-entropy step may divide by.
SFT_NORMALIZATIONS = ("token", "sequence", "document")

# DPO family (``DPOConfig.loss_type``, see ``jaxrl.losses.dpo``).
DPO_LOSS_TYPES = (
    "sigmoid",
    "dpo",
    "sigmoid_norm",
    "dpo_norm",
    "ipo",
    "hinge",
    "robust",
    "simpo",
    "wpo",
    "orpo",
)
DPO_SMOOTHING_LOSS_TYPES = ("sigmoid", "dpo", "sigmoid_norm", "dpo_norm", "simpo", "wpo", "robust")
DPO_MEAN_LOSS_TYPES = ("sigmoid_norm", "dpo_norm", "ipo", "simpo", "orpo")  # per-token means
DPO_REFERENCE_FREE = ("simpo", "orpo")  # no reference model, no reference cache
DPO_PAIR_ONLY = ("orpo",)  # types whose step normalisation is fixed (normalize must be pair)
DPO_ALIASES = {"dpo": "sigmoid", "dpo_norm": "sigmoid_norm"}
DPO_NORMALIZE = ("pair", "token")  # DPOConfig.normalize: pair → Σℓ/N_pairs, token → Σ T_p ℓ_p/Σ T_p

# KTO (``KTOConfig.loss_type``, see ``jaxrl.losses.kto``).
KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")
