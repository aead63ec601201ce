"""The objectives the train step minimises: SFT, DPO and the GRPO family, one factory each.

An objective is ``objective(model, mb) -> LossTerms``: one packed micro-batch (``[1, T]``
tokens, ``[1, S]`` documents) through the trainer's forward (``micro_batch_logprobs``: the
model's head, fp32 log-probs and entropy) into the pure loss of ``jaxrl.losses`` (numerator,
denominator and metric (sum, count) pairs, which the engine sums over micro-batches and ranks
and divides once). A trainer builds its objective from its config section and hands it to the
run as a value (``jaxrl.train.build``); ``jaxrl memory`` plans with :func:`sft_objective`.
:func:`on_params` turns one into the engine's ``loss_fn(params, mb)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.config import DPOConfig, GRPOConfig, KTOConfig, SFTConfig
from jaxrl.losses import load_balance
from jaxrl.losses.dpo import dpo_loss_terms, pair_documents
from jaxrl.losses.kto import kto_loss_terms
from jaxrl.losses.normalize import LossTerms
from jaxrl.losses.policy import policy_loss_terms
from jaxrl.losses.sampler_correction import sampler_weights
from jaxrl.losses.sft import sft_terms
from jaxrl.models.model_config import ModelConfig
from jaxrl.models.moe.trace import route_disagreement
from jaxrl.models.transformer import Transformer
from jaxrl.train.accumulate import LossFn, StepConstants
from jaxrl.train.forward import micro_batch_logprobs, routed_logprobs

Objective = Callable[[Transformer, dict[str, jax.Array]], LossTerms]

REF_FIELD = "ref_logp"  # DPO's per-document reference value: chosen → ref_c, rejected → ref_r
NLL_WEIGHT_FIELD = "nll_weight"  # ORPO's N_pairs / N_chosen_tokens of the step, [1] per slot
LABEL_FIELD = "label"  # KTO: 1 desirable, 0 undesirable, per document
Z0_FIELD = "kto_z0"  # KTO's reference point z₀ of the step, [1] per slot
MISMATCH = "sampler/logprob_mismatch"
ROUTE_DISAGREEMENT = "moe/route_disagreement"
OFF_POLICY = "policy/abs_log_ratio"


def on_params(objective: Objective, graphdef: Any) -> LossFn:
    """The engine's ``loss_fn(params, mb[, frozen])``: ``objective`` on the model ``graphdef``
    and the differentiated ``params`` make (with a LoRA run's frozen base: the adapters are
    ``params``, the base ``frozen``)."""

    def loss_fn(params: Any, mb: dict[str, jax.Array], frozen: Any = None) -> LossTerms:
        states = (params,) if frozen is None else (params, frozen)
        return objective(nnx.merge(graphdef, *states), mb)

    return loss_fn


def sft_objective(config: SFTConfig, *, chunk_size: int = 0) -> Objective:
    """Cross-entropy of the loss-masked targets (``sft_terms``), divided per
    ``config.loss_normalization`` (token / sequence / document)."""
    mode = config.loss_normalization

    def objective(model: Transformer, mb: dict[str, jax.Array]) -> LossTerms:
        logp_BT, _, moe = policy_logprobs(model, mb, chunk_size=chunk_size)
        segments = mb["doc_sample_index"].shape[-1]
        terms = sft_terms(
            logp_BT, mb["loss_mask"], mb["segment_ids"], mode=mode, num_segments=segments
        )
        return with_moe_terms(terms, moe)

    return objective


def dpo_objective(config: DPOConfig, *, chunk_size: int = 0) -> Objective:
    """DPO and its variants (``dpo_loss_terms``) on pairs laid out as adjacent chosen / rejected
    documents; the reference log-probs come per document in ``mb[REF_FIELD]`` (from the
    reference cache) unless the loss needs none (SimPO, ORPO). ORPO reads the step constant
    ``mb[NLL_WEIGHT_FIELD]`` (``[1]``: N_pairs / N_chosen_tokens, from the host plan)."""
    kwargs = dict(
        beta=config.beta,
        loss_type=config.loss_type,
        label_smoothing=config.label_smoothing,
        simpo_gamma=config.simpo_gamma,
        normalize=config.normalize,
    )
    needs_ref = config.needs_reference
    orpo = config.loss_type == "orpo"

    def objective(model: Transformer, mb: dict[str, jax.Array]) -> LossTerms:
        logp_BT, _, moe = policy_logprobs(model, mb, chunk_size=chunk_size)
        ref_c_BPr, ref_r_BPr = pair_documents(mb[REF_FIELD]) if needs_ref else (None, None)
        terms = dpo_loss_terms(
            logp_BT,
            mb["loss_mask"],
            mb["segment_ids"],
            ref_c_BPr,
            ref_r_BPr,
            num_segments=mb["doc_sample_index"].shape[-1],
            nll_weight=mb[NLL_WEIGHT_FIELD][0] if orpo else None,
            **kwargs,
        )
        return with_moe_terms(terms, moe)

    return objective


def kto_objective(config: KTOConfig, *, chunk_size: int = 0) -> Objective:
    """KTO (``kto_loss_terms``): one example per document, its reference value in
    ``mb[REF_FIELD]`` and label in ``mb[LABEL_FIELD]`` (per document), the step's z₀ in
    ``mb[Z0_FIELD]`` (a constant from the host's no-grad pre-pass)."""
    kwargs = dict(
        beta=config.beta,
        loss_type=config.loss_type,
        desirable_weight=config.desirable_weight,
        undesirable_weight=config.undesirable_weight,
    )

    def objective(model: Transformer, mb: dict[str, jax.Array]) -> LossTerms:
        logp_BT, _, moe = policy_logprobs(model, mb, chunk_size=chunk_size)
        terms = kto_loss_terms(
            logp_BT,
            mb["loss_mask"],
            mb["segment_ids"],
            mb[REF_FIELD],
            mb[LABEL_FIELD],
            mb[Z0_FIELD][0],
            num_segments=mb["doc_sample_index"].shape[-1],
            **kwargs,
        )
        return with_moe_terms(terms, moe)

    return objective


def grpo_objective(config: GRPOConfig, *, chunk_size: int = 0) -> Objective:
    """The GRPO family (``policy_loss_terms``) at the sampling temperature.

    Batch fields: ``advantage`` per document; ``sampler_logp`` and, when present, ``old_logp`` /
    ``ref_logp`` / ``token_advantage`` (``kl_in_reward``) per token (target-aligned);
    ``entropy_threshold`` ``[1]`` when ``top_entropy_quantile < 1`` (τ_H of the whole step, from
    a no-grad pre-pass).

    Adds ``sampler/logprob_mismatch`` = (Σ |logp − sampler_logp|·m, Σ m) over loss tokens, so the
    step reports the mean absolute gap between the trainer's and the sampler's log-probs; with
    scored old log-probs also ``policy/abs_log_ratio`` = the mean |log ρ| = |logp − old_logp|,
    which is exactly 0 at a batch's first use (the scorer runs the train step's forward).

    With ``importance_sampling_correction`` each token's policy term is weighted by
    π_old / π_sampler (``jaxrl.losses.sampler_correction``; π_old is the scored old log-probs,
    or the current ones on-policy), reporting ``sampler/is_ratio/mean`` and
    ``sampler/is_clipped_frac``.
    """
    use_entropy_mask = config.top_entropy_quantile < 1.0
    correction = config.importance_sampling_correction

    def objective(model: Transformer, mb: dict[str, jax.Array]) -> LossTerms:
        logp_BT, entropy_BT, moe = policy_logprobs(  # MoE: route metrics, router replay
            model, mb, chunk_size=chunk_size, temperature=config.temperature, routes=True
        )
        weight_BT, weight_metrics = None, {}
        if correction is not None:
            weight_BT, weight_metrics = sampler_weights(
                mb.get("old_logp", logp_BT),
                mb["sampler_logp"],
                mb["loss_mask"],
                mb["segment_ids"],
                num_segments=mb["advantage"].shape[-1],
                mode=correction,
                cap=config.importance_sampling_cap,
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
            beta=0.0 if config.kl_in_reward else config.beta,  # else β·KL is in the reward
            max_completion_length=config.max_completion_length,
            entropy_threshold=mb["entropy_threshold"][0] if use_entropy_mask else None,
            is_weight_BT=weight_BT,
            token_adv_BT=mb.get("token_advantage"),
            kl_bias_correction=config.use_bias_correction_kl,
            parent_ids_BT=mb.get("parent_ids"),  # shared-prompt packing: prompts are no documents
        )
        terms.metrics.update(weight_metrics)
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
        return with_moe_terms(terms, moe)

    return objective


def moe_route_metrics(
    trace: Any, recorded_BTLK: jax.Array | None, mb: dict[str, jax.Array]
) -> dict[str, tuple[jax.Array, jax.Array]]:
    """``moe/route_disagreement``: over the positions that predict a loss token, the fraction
    whose forward routes differ from the sampler's recorded ones in some MoE layer (with
    replay on, 0 by construction where routes were recorded). Reported as (0, 0) when the
    micro-batch carries no recorded routes."""
    if recorded_BTLK is None:
        zero = jnp.zeros((), jnp.float32)
        return {ROUTE_DISAGREEMENT: (zero, zero)}
    mask_BT = (mb["loss_mask"] > 0) & (mb["segment_ids"] > 0)
    return {ROUTE_DISAGREEMENT: route_disagreement(trace.routes_BTLK, recorded_BTLK, mask_BT)}


MoeTerms = tuple[jax.Array | None, dict[str, tuple[jax.Array, jax.Array]]]


def policy_logprobs(
    model: Transformer,
    mb: dict[str, jax.Array],
    *,
    chunk_size: int = 0,
    temperature: float | jax.Array = 1.0,
    routes: bool = False,
) -> tuple[jax.Array, jax.Array, MoeTerms]:
    """``(logp_BT, entropy_BT, moe)``: :func:`micro_batch_logprobs`, and for a MoE model the
    terms :func:`with_moe_terms` adds: ``routes`` (GRPO) reports ``moe/route_disagreement``;
    ``router_aux_loss_coef > 0`` adds the load-balance loss (``jaxrl.losses.load_balance``:
    the pre-pass reports the expert counts, the gradient pass adds the loss). A dense model, or
    a MoE one with neither, runs the plain forward."""
    cfg = model.config
    balance = bool(cfg.moe_layers) and cfg.router_aux_loss_coef > 0
    if not (cfg.moe_layers and (routes or balance)):
        logp_BT, entropy_BT = micro_batch_logprobs(
            model, mb, chunk_size=chunk_size, temperature=temperature
        )
        return logp_BT, entropy_BT, (None, {})
    logp_BT, entropy_BT, trace, recorded = routed_logprobs(
        model, mb, chunk_size=chunk_size, temperature=temperature
    )
    metrics = moe_route_metrics(trace, recorded, mb) if routes else {}
    aux = None
    if balance and load_balance.F_FIELD in mb:  # the gradient pass
        aux, balance_metrics = load_balance.balance_terms(
            trace.probs_BTE,
            mb["segment_ids"],
            mb[load_balance.F_FIELD][0],
            mb[load_balance.SCALE_FIELD][0],
            coef=cfg.router_aux_loss_coef,
            num_layers=len(cfg.moe_layers),
            top_k=cfg.num_experts_per_tok,
        )
        metrics.update(balance_metrics)
    elif balance:  # the engine's pre-pass: the step's expert counts
        counts = load_balance.expert_counts(trace.routes_BTLK, mb["segment_ids"], cfg.num_experts)
        metrics[load_balance.COUNTS] = counts
    return logp_BT, entropy_BT, (aux, metrics)


def with_moe_terms(terms: LossTerms, moe: MoeTerms) -> LossTerms:
    """``terms`` with :func:`policy_logprobs`'s MoE metrics and load-balance numerator."""
    aux, metrics = moe
    if aux is None and not metrics:
        return terms
    numerator = terms.numerator if aux is None else terms.numerator + aux
    return LossTerms(numerator, terms.denominator, {**terms.metrics, **metrics})


def load_balance_constants(config: ModelConfig) -> StepConstants | None:
    """The engine's ``step_constants`` for a MoE model with ``router_aux_loss_coef > 0`` (the
    step's expert fractions f_e and max(D, 1) / N from the pre-pass's sums); None otherwise
    (no pre-pass: the step program is unchanged)."""
    if not config.moe_layers or config.router_aux_loss_coef <= 0:
        return None

    def constants(sums: LossTerms) -> dict[str, jax.Array]:
        counts_E, rows = sums.metrics[load_balance.COUNTS]
        return load_balance.step_constants(counts_E, rows, sums.denominator)

    return constants
