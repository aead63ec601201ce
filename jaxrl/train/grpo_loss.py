"""The GRPO-family loss of one packed micro-batch, as the engine calls it.

``micro_batch_logprobs`` (logits / temperature, the model's head, fp32 log-probs and entropy)
→ ``policy_loss_terms`` (numerator, denominator, clip / KL / entropy metrics), plus the
sampler/trainer agreement metric. Batch fields (``[1, T]`` tokens, ``[1, S]`` documents):
``advantage`` per document; ``sampler_logp`` and, when present, ``old_logp`` / ``ref_logp`` per
token (target-aligned); ``entropy_threshold`` ``[1]`` when ``top_entropy_quantile < 1`` (τ_H of
the whole step, from a no-grad pre-pass).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxrl.config import GRPOConfig
from jaxrl.losses.normalize import LossTerms
from jaxrl.losses.policy import policy_loss_terms
from jaxrl.models.transformer import Transformer
from jaxrl.train.forward import micro_batch_logprobs

MISMATCH = "sampler/logprob_mismatch"
OFF_POLICY = "policy/abs_log_ratio"


def grpo_loss(
    config: GRPOConfig, *, chunk_size: int = 0
) -> Callable[[Transformer, dict[str, jax.Array]], LossTerms]:
    """``loss(model, mb) -> LossTerms`` for the engine.

    Adds ``sampler/logprob_mismatch`` = (Σ |logp − sampler_logp|·m, Σ m) over loss tokens, so the
    step reports the mean absolute gap between the trainer's and the sampler's log-probs; with
    scored old log-probs also ``policy/abs_log_ratio`` = the mean |log ρ| = |logp − old_logp|,
    which is exactly 0 at a batch's first use (the scorer runs the train step's forward).
    """
    use_entropy_mask = config.top_entropy_quantile < 1.0

    def loss(model: Transformer, mb: dict[str, jax.Array]) -> LossTerms:
        logp_BT, entropy_BT = micro_batch_logprobs(
            model, mb, chunk_size=chunk_size, temperature=config.temperature
        )
        terms = policy_loss_terms(
            logp_BT,
            mb.get("old_logp"),
            mb.get("ref_logp"),
            mb["advantage"],
            mb["loss_mask"],
            mb["segment_ids"],
            entropy_BT,
            loss_type=config.loss_type,
            importance_sampling_level=config.importance_sampling_level,
            epsilon=config.epsilon,
            epsilon_high=config.epsilon_high,
            delta=config.delta,
            beta=config.beta,
            max_completion_length=config.max_completion_length,
            entropy_threshold=mb["entropy_threshold"][0] if use_entropy_mask else None,
        )
        m_BT = (mb["loss_mask"] > 0) & (mb["segment_ids"] > 0)
        gap_BT = jnp.abs(jax.lax.stop_gradient(logp_BT) - mb["sampler_logp"])
        terms.metrics[MISMATCH] = (
            jnp.sum(jnp.where(m_BT, gap_BT, 0.0)),
            jnp.sum(m_BT.astype(jnp.float32)),
        )
        if "old_logp" in mb:
            log_ratio_BT = jnp.abs(jax.lax.stop_gradient(logp_BT) - mb["old_logp"])
            terms.metrics[OFF_POLICY] = (
                jnp.sum(jnp.where(m_BT, log_ratio_BT, 0.0)),
                jnp.sum(m_BT.astype(jnp.float32)),
            )
        return terms

    return loss
