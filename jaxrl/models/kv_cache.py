"""Preallocated KV cache for decoding with :meth:`Transformer.decode`.

The cache has a static length L. Every slot carries the segment id and position of the token
written there, so decoding uses the same visibility rule as training (``attention.py``)::

    visible[b, t, l] = (q_segment[b, t] == kv_segment[b, l]) and (kv_pos[b, l] <= q_pos[b, t])

Unwritten slots hold segment ``EMPTY = -1``, which equals no query's segment (queries use 0 for
padding and 1.. for documents), so they are invisible to every query without a separate mask.

All rows write at the same slot ``index`` (a traced int32 scalar): a batch of prompts of
different lengths is left-padded, with padding in segment 0 (invisible to the real tokens), so
that every row's next token goes to slot ``P + step``. Writing past ``L`` is a caller error
(``lax.dynamic_update_slice`` would clamp the index); ``Transformer.decode`` rejects a step
longer than the cache, and samplers size the cache as ``P + max_new_tokens``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax import lax

if TYPE_CHECKING:
    from jaxrl.models.transformer import ModelConfig

EMPTY = -1  # segment id of an unwritten slot


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerKV:
    """One layer's view of the cache: its keys and values plus the shared slot metadata."""

    keys_BLKDh: jax.Array  # compute dtype, after RoPE (and q/k norm)
    values_BLKDh: jax.Array
    segment_ids_BL: jax.Array  # int32, EMPTY on unwritten slots
    positions_BL: jax.Array  # int32
    index: jax.Array  # int32 scalar: first slot of the tokens being written

    def append(self, k_BTKDh: jax.Array, v_BTKDh: jax.Array) -> LayerKV:
        """Write T new keys and values at slots ``[index, index + T)`` (index unchanged)."""
        start = (0, self.index, 0, 0)
        return dataclasses.replace(
            self,
            keys_BLKDh=lax.dynamic_update_slice(
                self.keys_BLKDh, k_BTKDh.astype(self.keys_BLKDh.dtype), start
            ),
            values_BLKDh=lax.dynamic_update_slice(
                self.values_BLKDh, v_BTKDh.astype(self.values_BLKDh.dtype), start
            ),
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Keys and values of every layer ``[B, L, K, Dh]``, slot segments/positions, write index."""

    keys: tuple[jax.Array, ...]  # per layer [B, L, K, Dh]
    values: tuple[jax.Array, ...]  # per layer [B, L, K, Dh]
    segment_ids_BL: jax.Array  # int32, EMPTY on unwritten slots
    positions_BL: jax.Array  # int32
    index: jax.Array  # int32 scalar: next slot to write

    @classmethod
    def empty(cls, config: ModelConfig, batch: int, length: int) -> KVCache:
        """An all-EMPTY cache of ``length`` slots in the model's compute dtype."""
        shape = (batch, length, config.num_key_value_heads, config.head_dim)
        zeros = tuple(jnp.zeros(shape, config.dtype) for _ in range(config.num_hidden_layers))
        return cls(
            keys=zeros,
            values=zeros,
            segment_ids_BL=jnp.full((batch, length), EMPTY, jnp.int32),
            positions_BL=jnp.zeros((batch, length), jnp.int32),
            index=jnp.zeros((), jnp.int32),
        )

    @property
    def length(self) -> int:
        """L, the static number of slots."""
        return int(self.segment_ids_BL.shape[1])

    def write_slots(self, segment_ids_BT: jax.Array, positions_BT: jax.Array) -> KVCache:
        """Record the segment ids and positions of T tokens at ``[index, index + T)``."""
        start = (0, self.index)
        return dataclasses.replace(
            self,
            segment_ids_BL=lax.dynamic_update_slice(
                self.segment_ids_BL, segment_ids_BT.astype(jnp.int32), start
            ),
            positions_BL=lax.dynamic_update_slice(
                self.positions_BL, positions_BT.astype(jnp.int32), start
            ),
        )

    def layer(self, i: int) -> LayerKV:
        """Layer ``i``'s view (call after :meth:`write_slots`)."""
        return LayerKV(
            self.keys[i], self.values[i], self.segment_ids_BL, self.positions_BL, self.index
        )

    def advance(self, layers: list[LayerKV], num_tokens: int) -> KVCache:
        """The cache holding every layer's updated keys/values, index moved by ``num_tokens``."""
        return dataclasses.replace(
            self,
            keys=tuple(kv.keys_BLKDh for kv in layers),
            values=tuple(kv.values_BLKDh for kv in layers),
            index=self.index + num_tokens,
        )
