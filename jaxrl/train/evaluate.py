"""Held-out exact match by teacher forcing.

A document is correct when the argmax prediction is right at every loss position given the
true prefix. Under greedy decoding each step then sees a correct prefix, so this equals greedy
exact-match accuracy, computed in one forward pass.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.losses.normalize import segment_sum
from jaxrl.models.transformer import Transformer


def exact_match_counts(
    model: Transformer, mb: dict[str, jax.Array], *, num_segments: int
) -> tuple[jax.Array, jax.Array]:
    """``(correct documents, scored documents)`` of a packed batch ``[B, T]``."""
    logits_BTV = model(mb["tokens"], mb.get("positions"), mb["segment_ids"])
    wrong_BT = (jnp.argmax(logits_BTV, axis=-1) != mb["targets"]).astype(jnp.float32)
    mask_BT = mb["loss_mask"].astype(jnp.float32)
    wrong_BS = segment_sum(wrong_BT * mask_BT, mb["segment_ids"], num_segments)[:, 1:]
    scored_BS = segment_sum(mask_BT, mb["segment_ids"], num_segments)[:, 1:] > 0
    correct = jnp.sum(scored_BS & (wrong_BS == 0))
    return correct, jnp.sum(scored_BS)
