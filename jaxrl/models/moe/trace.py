"""What a forward of a MoE model records of its routing, and how it replays given routes.

:class:`MoeTrace` holds, for every token, the expert ids each MoE layer chose (``routes``,
``[B, T, Lm, K]`` int32, Lm = MoE layers in order; the rollout row's layout) and the sum over
the MoE layers of the router's softmax (``probs``, ``[B, T, E]`` float32; the load-balance loss
is linear in it, ``jaxrl/losses/load_balance.py``). :func:`trace_step` builds the layer-stack step
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
    """``step(block, carry, i, seg_BT, pos_BT, replay_LBTK[, parent_BT])`` for ``run_blocks``
    with carry ``(x_BTD, cache | None, routes_LBTK, probs_BTE)``: runs ``block.routed``, writes
    the MoE layer's ids and adds its probabilities (``parent_BT``: shared-prompt parents,
    ``Transformer.hidden_states``)."""
    moe_index = {layer: j for j, layer in enumerate(config.moe_layers)}

    def step(block, carry, i, seg_BT, pos_BT, replay_LBTK, parent_BT=None):
        x_BTD, cache, routes_LBTK, probs_BTE = carry
        # scanned stacks are all MoE (ModelConfig checks it): slot i; unrolled: i is static,
        # unless the blocks run in a loop (layer_stack.run_blocks(looped=True): one structure,
        # so all MoE when this step routes): slot i too
        j = moe_index.get(i) if isinstance(i, int) else i
        replay_BTK = None
        if replay_LBTK is not None and j is not None:
            replay_BTK = jax.lax.dynamic_index_in_dim(replay_LBTK, j, 0, keepdims=False)
        layer_kv = None if cache is None else cache.layer(i)
        x_BTD, layer_kv, routing = block.routed(
            x_BTD, seg_BT, pos_BT, layer_kv, replay_BTK, parent_BT
        )
        if cache is not None:
            cache = cache.store(layer_kv)
        if routing is not None:
            b, t = seg_BT.shape
            ids_BTK = routing.ids_NK.reshape(b, t, -1)
            routes_LBTK = jax.lax.dynamic_update_index_in_dim(routes_LBTK, ids_BTK, j, 0)
            probs_BTE = probs_BTE + routing.probs_NE.reshape(b, t, -1)
        return x_BTD, cache, routes_LBTK, probs_BTE

    return step


ROUTE_FIELD = "moe_route_{layer}_{k}"  # a rollout row's token field per (MoE layer, choice)


def route_field_names(config: ModelConfig) -> list[str]:
    """The token fields that carry recorded routes through the packer: one per (MoE layer,
    top-k choice), in ``[Lm, K]`` order."""
    lm, k = len(config.moe_layers), config.num_experts_per_tok
    return [ROUTE_FIELD.format(layer=j, k=i) for j in range(lm) for i in range(k)]


def route_fields(routes_TLK: Any, num_tokens: int) -> dict[str, Any]:
    """A document's recorded routes (numpy ``[T', Lm, K]``, for its first T' <= num_tokens
    tokens, in *token* alignment: row t = the experts token t went through) as float32 token
    fields of ``num_tokens`` values that the packer's target shift (``data/batching/packing.py``:
    position t carries value t + 1) brings back to token alignment: value ``t + 1`` holds token
    t's id + 1; 0 = not recorded (the forward keeps its own top-k there)."""
    import numpy as np

    routes = np.asarray(routes_TLK, np.int64)
    t, lm, k = routes.shape
    out = {}
    for j in range(lm):
        for i in range(k):
            values = np.zeros(num_tokens, np.float32)
            values[1 : t + 1] = routes[: num_tokens - 1, j, i] + 1
            out[ROUTE_FIELD.format(layer=j, k=i)] = values
    return out


def batch_routes(mb: dict[str, jax.Array], config: ModelConfig) -> jax.Array | None:
    """The recorded routes of a packed micro-batch, ``[B, T, Lm, K]`` int32 (-1 = none), from
    its :func:`route_fields`; None when it has none."""
    names = route_field_names(config)
    if not names or names[0] not in mb:
        return None
    lm, k = len(config.moe_layers), config.num_experts_per_tok
    stacked = jnp.stack([mb[n] for n in names], axis=-1)  # [B, T, Lm·K]
    ids = jnp.round(stacked).astype(jnp.int32) - 1
    return ids.reshape(*ids.shape[:-1], lm, k)


def route_disagreement(
    train_BTLK: jax.Array, sampler_BTLK: jax.Array, mask_BT: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """(Σ, count) over the masked tokens with recorded routes of "the forward's expert set
    differs from the sampler's in some MoE layer" (sets: the order of the top-k is ignored)."""
    recorded_BT = jnp.all(sampler_BTLK >= 0, axis=(-2, -1))
    same_BTL = jnp.all(jnp.sort(train_BTLK, -1) == jnp.sort(sampler_BTLK, -1), axis=-1)
    differs_BT = ~jnp.all(same_BTL, axis=-1)
    on_BT = mask_BT & recorded_BT
    return (
        jnp.sum(jnp.where(on_BT, differs_BT, False).astype(jnp.float32)),
        jnp.sum(on_BT.astype(jnp.float32)),
    )
