"""The MoE load-balance auxiliary loss over a whole optimizer step (docs/moe.md).

transformers' ``load_balancing_loss_func`` (Switch Transformer, eqs. 4-6), with its Qwen3-MoE
conventions: the router outputs of the L_m MoE layers are concatenated, so every (layer, token)
pair is one row; N = L_m × (non-padding tokens) rows;

    f_e = (1 / N) Σ_rows Σ_k 1[expert e is the row's k-th choice]        (Σ_e f_e = K)
    P_e = (1 / N) Σ_rows softmax(router logits)_e
    aux = coef · E · Σ_e f_e · P_e

f_e is a count (no gradient flows through a top-k); the gradient flows through P_e. Per
micro-batch, f and P would each be a batch mean and their product would depend on how the step
was cut. Here both are means over the **whole optimizer step**: f_e comes from a no-grad
pre-pass over the step's micro-batches (the engine's ``step_constants``: the routes the training
forward takes, which are the rollout's recorded routes under router replay) and enters the
gradient pass as a constant, so aux is linear in the per-token router probabilities:

    aux = Σ_{micro-batches} coef · E · Σ_e f_e · S_e / N,   S_e = Σ_{t in micro-batch} p_{t,e}

(p summed over the MoE layers). The engine divides the step's numerator once by its
denominator D (``normalize.finalize``: max(D, 1)), so each micro-batch adds
``aux_mb · max(D, 1) / N`` to the numerator, with D and N also from the pre-pass: the step
loss is exactly ``main + aux`` for any micro-batching, packing and device count.

Which tokens count: every non-padding input token (``segment_ids > 0``), prompt and
completion alike, as transformers counts every token its attention mask keeps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

F_FIELD = "moe_balance_f"  # [1, E] micro-batch field: the step's f_e (from the pre-pass)
SCALE_FIELD = "moe_balance_scale"  # [1]: max(D, 1) / N of the step
COUNTS = "moe/expert_counts"  # pre-pass only: (Σ_rows Σ_k 1[e chosen] per expert [E], rows)
AUX_LOSS = "moe/aux_loss"  # coef · E · Σ_e f_e P_e of the step
MAX_LOAD = "moe/max_expert_load"  # max_e f_e · E / K: 1 = balanced, E / K = one expert


def expert_counts(
    routes_BTLK: jax.Array, segment_ids_BT: jax.Array, num_experts: int
) -> tuple[jax.Array, jax.Array]:
    """``(counts [E], rows)``: per expert, how many (layer, token, choice) triples of the real
    tokens chose it, and the number of (layer, token) rows; float32 (exact integers)."""
    real_BT = segment_ids_BT > 0
    hits_BTLKE = jax.nn.one_hot(routes_BTLK, num_experts, dtype=jnp.float32)
    counts_E = jnp.sum(jnp.where(real_BT[:, :, None, None, None], hits_BTLKE, 0.0), (0, 1, 2, 3))
    rows = jnp.sum(real_BT.astype(jnp.float32)) * routes_BTLK.shape[2]
    return counts_E, rows


def step_constants(counts_E: jax.Array, rows: jax.Array, denominator: jax.Array) -> dict:
    """The gradient pass's micro-batch fields from the pre-pass's step sums (counts and rows
    summed over every micro-batch and rank, the main loss's denominator D)."""
    n = jnp.maximum(rows, 1.0)
    return {
        F_FIELD: (counts_E / n)[None],
        SCALE_FIELD: (jnp.maximum(denominator, 1.0) / n)[None],
    }


def balance_terms(
    probs_BTE: jax.Array,
    segment_ids_BT: jax.Array,
    f_E: jax.Array,
    scale: jax.Array,
    *,
    coef: float,
    num_layers: int,
    top_k: int,
) -> tuple[jax.Array, dict[str, tuple[jax.Array, jax.Array]]]:
    """``(numerator, metrics)`` of one micro-batch: ``coef · E · Σ_e f_e S_e · scale`` (what it
    adds to the step's numerator) and the (sum, count) pairs of ``moe/aux_loss`` and
    ``moe/max_expert_load`` (the step values once summed). ``probs_BTE``: Σ over the MoE
    layers of the router softmax per token."""
    e = probs_BTE.shape[-1]
    real_BT = segment_ids_BT > 0
    s_E = jnp.sum(jnp.where(real_BT[..., None], probs_BTE.astype(jnp.float32), 0.0), (0, 1))
    aux = coef * e * jnp.sum(jax.lax.stop_gradient(f_E) * s_E)
    rows = jnp.sum(real_BT.astype(jnp.float32)) * num_layers
    load = jnp.max(f_E) * e / top_k
    metrics = {AUX_LOSS: (jax.lax.stop_gradient(aux), rows), MAX_LOAD: (load * rows, rows)}
    return aux * jax.lax.stop_gradient(scale), metrics
