"""What a forward of a MoE model records of its routing, and how it replays given routes.

:class:`MoeTrace` holds, for every token, the expert ids each MoE layer chose (``routes``,
``[B, T, Lm, K]`` int32, Lm = MoE layers in order; the rollout row's layout) and the sum over
the MoE layers of the router's softmax (``probs``, ``[B, T, E]`` float32; the load-balance loss
is linear in it, ``balance.py``). :func:`trace_step` builds the layer-stack step
(``layer_stack.run_blocks``) that fills it, layer ``i`` writing slot ``moe_index(i)``, and that
feeds each MoE layer its slot of replayed routes when given.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxrl.models.model_config import ModelConfig


class MoeTrace(NamedTuple):
    routes_BTLK: jax.Array  # int32 expert ids per token per MoE layer
    probs_BTE: jax.Array  # float32 Σ over MoE layers of the router softmax


def empty_trace(config: ModelConfig, b: int, t: int) -> tuple[jax.Array, jax.Array]:
    """The carried buffers: routes ``[Lm, B, T, K]`` (layer-major, written slot by slot) and
    ``probs [B, T, E]``."""
    lm, k, e = len(config.moe_layers), config.num_experts_per_tok, config.num_experts
    return jnp.zeros((lm, b, t, k), jnp.int32), jnp.zeros((b, t, e), jnp.float32)


def finish(routes_LBTK: jax.Array, probs_BTE: jax.Array) -> MoeTrace:
    return MoeTrace(jnp.moveaxis(routes_LBTK, 0, 2), probs_BTE)


def replay_layers(routes_BTLK: jax.Array | None) -> jax.Array | None:
    """Replayed routes in the layer-major layout the stack indexes ([Lm, B, T, K])."""
    return None if routes_BTLK is None else jnp.moveaxis(jnp.asarray(routes_BTLK), 2, 0)


def trace_step(config: ModelConfig) -> Callable[..., Any]:
    """``step(block, carry, i, seg_BT, pos_BT, replay_LBTK)`` for ``run_blocks`` with carry
    ``(x_BTD, cache | None, routes_LBTK, probs_BTE)``: runs ``block.routed``, writes the MoE
    layer's ids and adds its probabilities."""
    moe_index = {layer: j for j, layer in enumerate(config.moe_layers)}

    def step(block, carry, i, seg_BT, pos_BT, replay_LBTK):
        x_BTD, cache, routes_LBTK, probs_BTE = carry
        # scanned stacks are all MoE (ModelConfig checks it): slot i; unrolled: i is static
        j = i if config.scan_layers else moe_index.get(i)
        replay_BTK = None
        if replay_LBTK is not None and j is not None:
            replay_BTK = jax.lax.dynamic_index_in_dim(replay_LBTK, j, 0, keepdims=False)
        layer_kv = None if cache is None else cache.layer(i)
        x_BTD, layer_kv, routing = block.routed(x_BTD, seg_BT, pos_BT, layer_kv, replay_BTK)
        if cache is not None:
            cache = cache.store(layer_kv)
        if routing is not None:
            b, t = seg_BT.shape
            ids_BTK = routing.ids_NK.reshape(b, t, -1)
            routes_LBTK = jax.lax.dynamic_update_index_in_dim(routes_LBTK, ids_BTK, j, 0)
            probs_BTE = probs_BTE + routing.probs_NE.reshape(b, t, -1)
        return x_BTD, cache, routes_LBTK, probs_BTE

    return step
