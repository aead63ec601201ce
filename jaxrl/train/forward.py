"""The trainer's forward: packed micro-batch → per-token log-probs and entropy (fp32)."""

from __future__ import annotations

import jax

from jaxrl.models.head import token_logprobs
from jaxrl.models.transformer import Transformer


def micro_batch_logprobs(
    model: Transformer,
    mb: dict[str, jax.Array],
    *,
    chunk_size: int | None = None,
    temperature: float = 1.0,
) -> tuple[jax.Array, jax.Array]:
    """``(logp_BT, entropy_BT)`` of ``mb["targets"]`` given ``mb["tokens"]`` (target-aligned).

    Positions restart per document (from ``segment_ids``) unless ``mb`` carries ``positions``.
    The head is the model's (fp32 when ``fp32_lm_head``), chunked over tokens.
    """
    hidden_BTD = model.hidden_states(mb["tokens"], mb.get("positions"), mb["segment_ids"])
    kernel_DV = model.head_kernel()
    if not model.config.fp32_lm_head:
        kernel_DV = kernel_DV.astype(hidden_BTD.dtype)
    return token_logprobs(
        hidden_BTD,
        kernel_DV,
        mb["targets"],
        fp32=model.config.fp32_lm_head,
        temperature=temperature,
        chunk_size=chunk_size or None,
    )
