"""Routing and the grouped expert matmul of a sparse MoE block (Qwen3-MoE, transformers'
``Qwen3MoeTopKRouter`` + ``Qwen3MoeExperts``), as pure functions of arrays.

Router: logits ``x W_r`` and their softmax in float32 (``Precision.HIGHEST``), the top-k
probabilities (``lax.top_k``: ties to the lower expert id, as ``torch.topk``), renormalised to
sum to 1 when ``norm_topk_prob``. With replayed ids (rollout router replay, docs/moe.md) the
router's top-k is replaced by them (a token whose ids are negative keeps its own) and the
probabilities are gathered at the ids, so the router still gets gradients through them.

Experts: the N·k (token, expert) pairs are sorted by expert id and every expert's SwiGLU runs on
its contiguous group with one ``jax.lax.ragged_dot`` per projection (CPU, GPU and TPU). There is
no capacity: every pair is computed, so a token's output never depends on its batch mates. On the
CPU the pairs go in chunks (:func:`ragged_dot`): jax lowers ``ragged_dot`` there as a dense
expansion. The outputs are unsorted and summed over k with the routing weights in float32.

Expert parallelism (``expert_shard``): a device holding experts ``[e0, e0 + El)`` counts only
pairs routed to them; the other pairs sort past the groups, where ``ragged_dot`` writes zeros,
so summing the devices' outputs (a ``psum`` over the ``expert`` axis) gives the full result.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class Routing(NamedTuple):
    """One MoE layer's routing of N tokens."""

    weights_NK: jax.Array  # float32 routing weights of the chosen experts
    ids_NK: jax.Array  # int32 expert ids
    probs_NE: jax.Array  # float32 softmax over all experts (the load-balance loss reads it)


def route(
    x_ND: jax.Array,
    router_DE: jax.Array,
    top_k: int,
    norm_topk_prob: bool,
    replay_NK: jax.Array | None = None,
) -> Routing:
    """The router: fp32 logits and softmax, top-k (or ``replay_NK``'s ids), renormalised."""
    logits_NE = jnp.matmul(
        x_ND.astype(jnp.float32), router_DE.astype(jnp.float32), precision="highest"
    )
    probs_NE = jax.nn.softmax(logits_NE, axis=-1)
    weights_NK, ids_NK = jax.lax.top_k(probs_NE, top_k)
    if replay_NK is not None:  # a token whose replayed ids are negative keeps its own top-k
        replay_NK = replay_NK.astype(jnp.int32)
        own_N1 = jnp.any(replay_NK < 0, axis=-1, keepdims=True)
        ids_NK = jnp.where(own_N1, ids_NK, jnp.clip(replay_NK, 0, probs_NE.shape[-1] - 1))
        weights_NK = jnp.take_along_axis(probs_NE, ids_NK, axis=-1)
    if norm_topk_prob:
        weights_NK = weights_NK / jnp.sum(weights_NK, axis=-1, keepdims=True)
    return Routing(weights_NK, ids_NK.astype(jnp.int32), probs_NE)


class ExpertWeights(NamedTuple):
    """The (local) experts' kernels in the compute dtype, and optional LoRA factors."""

    gate_EDF: jax.Array
    up_EDF: jax.Array
    down_EFD: jax.Array
    gate_lora: tuple[jax.Array, jax.Array] | None = None  # (A [E, D, r], B [E, r, F])
    up_lora: tuple[jax.Array, jax.Array] | None = None
    down_lora: tuple[jax.Array, jax.Array] | None = None
    scaling: float = 0.0


CPU_CHUNK = 256  # pairs per grouped matmul on the CPU (its ragged_dot is a dense expansion)


def ragged_dot(x_MK: jax.Array, w_GKN: jax.Array, group_sizes_G: jax.Array) -> jax.Array:
    """``jax.lax.ragged_dot(x_MK, w_GKN, group_sizes_G)``. On the CPU, where jax lowers it as a
    dense expansion (``x`` masked into ``[G, M, K]``, so a 128-expert layer at 4k-token rows
    holds tens of GiB), the M sorted pairs go :data:`CPU_CHUNK` at a time (:func:`_chunked`):
    each pair's row is the same computation, only ``[G, CPU_CHUNK, K]`` is live. Accelerators
    lower the grouped matmul as it is (``lax.platform_dependent``)."""
    if x_MK.shape[0] <= CPU_CHUNK:
        return jax.lax.ragged_dot(x_MK, w_GKN, group_sizes_G)
    return jax.lax.platform_dependent(
        x_MK, w_GKN, group_sizes_G, cpu=_chunked, default=jax.lax.ragged_dot
    )


def _chunk_sizes(group_sizes_G: jax.Array, first: jax.Array, chunk: int) -> jax.Array:
    """The groups' row counts within the sorted rows ``[first, first + chunk)``."""
    ends_G = jnp.cumsum(group_sizes_G)
    starts_G = ends_G - group_sizes_G
    inside = lambda at: jnp.clip(at - first, 0, chunk)  # noqa: E731
    return (inside(ends_G) - inside(starts_G)).astype(group_sizes_G.dtype)


def _chunks(x_MK: jax.Array) -> tuple[jax.Array, jax.Array]:
    m, n = x_MK.shape[0], -(-x_MK.shape[0] // CPU_CHUNK)
    x_NcCK = jnp.pad(x_MK, ((0, n * CPU_CHUNK - m), (0, 0))).reshape(n, CPU_CHUNK, -1)
    return x_NcCK, jnp.arange(n) * CPU_CHUNK


@jax.custom_vjp
def _chunked(x_MK: jax.Array, w_GKN: jax.Array, group_sizes_G: jax.Array) -> jax.Array:
    """``ragged_dot`` a chunk of sorted rows at a time (rows past the groups stay zero)."""
    x_NcCK, firsts = _chunks(x_MK)

    def one(args: tuple[jax.Array, jax.Array]) -> jax.Array:
        x_CK, first = args
        return jax.lax.ragged_dot(x_CK, w_GKN, _chunk_sizes(group_sizes_G, first, CPU_CHUNK))

    y_NcCN = jax.lax.map(one, (x_NcCK, firsts))
    return y_NcCN.reshape(-1, y_NcCN.shape[-1])[: x_MK.shape[0]]


def _chunked_fwd(x_MK, w_GKN, group_sizes_G):
    return _chunked(x_MK, w_GKN, group_sizes_G), (x_MK, w_GKN, group_sizes_G)


def _chunked_bwd(residuals, ct_MN):
    """Each chunk's ``ragged_dot`` transpose; the kernel's cotangent (one rounding per chunk,
    as the whole ``ragged_dot`` rounds once) summed over the chunks in float32."""
    x_MK, w_GKN, group_sizes_G = residuals
    x_NcCK, firsts = _chunks(x_MK)
    ct_NcCN, _ = _chunks(ct_MN)

    def one(dw_GKN, args):
        x_CK, ct_CN, first = args
        sizes = _chunk_sizes(group_sizes_G, first, CPU_CHUNK)
        _, vjp = jax.vjp(lambda x, w: jax.lax.ragged_dot(x, w, sizes), x_CK, w_GKN)
        dx_CK, dw = vjp(ct_CN)
        return dw_GKN + dw.astype(jnp.float32), dx_CK

    zero = jnp.zeros(w_GKN.shape, jnp.float32)
    dw_GKN, dx_NcCK = jax.lax.scan(one, zero, (x_NcCK, ct_NcCN, firsts))
    dx_MK = dx_NcCK.reshape(-1, x_MK.shape[-1])[: x_MK.shape[0]]
    return dx_MK, dw_GKN.astype(w_GKN.dtype), None


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def _grouped(
    x_MFi: jax.Array,
    kernel_EFiFo: jax.Array,
    lora: tuple[jax.Array, jax.Array] | None,
    scaling: float,
    group_sizes_E: jax.Array,
) -> jax.Array:
    y_MFo = ragged_dot(x_MFi, kernel_EFiFo, group_sizes_E)
    if lora is None:
        return y_MFo
    a_EFiR, b_ERFo = lora
    xa_MR = ragged_dot(x_MFi.astype(a_EFiR.dtype), a_EFiR, group_sizes_E)
    delta_MFo = ragged_dot(xa_MR, b_ERFo, group_sizes_E)
    return y_MFo + (delta_MFo * scaling).astype(y_MFo.dtype)


def experts(
    x_ND: jax.Array,
    routing: Routing,
    w: ExpertWeights,
    expert_shard: tuple[Any, int] | None = None,
) -> jax.Array:
    """``Σ_k weight_k · expert_{id_k}(x)`` per token, [N, D] in ``x_ND``'s dtype.

    ``expert_shard = (first, count)``: ``w`` holds experts ``[first, first + count)`` only and
    the result is this device's partial sum in float32 (pairs routed elsewhere contribute
    zeros), for the caller to add up over the devices and cast."""
    n, d = x_ND.shape
    k = routing.ids_NK.shape[-1]
    ids_M = routing.ids_NK.reshape(-1)
    num_local = w.gate_EDF.shape[0]
    if expert_shard is not None:
        first, _ = expert_shard
        local_M = ids_M - first
        inside_M = (local_M >= 0) & (local_M < num_local)
        ids_M = jnp.where(inside_M, local_M, num_local)  # elsewhere: sorted past every group
    order_M = jnp.argsort(ids_M, stable=True)
    group_sizes_E = jnp.bincount(ids_M, length=num_local).astype(jnp.int32)
    xs_MD = jnp.take(x_ND, order_M // k, axis=0)
    gate_MF = _grouped(xs_MD, w.gate_EDF, w.gate_lora, w.scaling, group_sizes_E)
    up_MF = _grouped(xs_MD, w.up_EDF, w.up_lora, w.scaling, group_sizes_E)
    h_MF = jax.nn.silu(gate_MF) * up_MF
    ys_MD = _grouped(h_MF, w.down_EFD, w.down_lora, w.scaling, group_sizes_E)
    inverse_M = jnp.zeros_like(order_M).at[order_M].set(jnp.arange(order_M.shape[0]))
    y_NKD = jnp.take(ys_MD, inverse_M, axis=0).reshape(n, k, d)
    out_ND = jnp.einsum(
        "nkd,nk->nd", y_NKD.astype(jnp.float32), routing.weights_NK, precision="highest"
    )
    return out_ND if expert_shard is not None else out_ND.astype(x_ND.dtype)
