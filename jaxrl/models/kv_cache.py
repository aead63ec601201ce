"""Preallocated KV cache for decoding with :meth:`Transformer.decode`.

The cache has a static length L. Every entry carries the segment id and position of the token
written there, so decoding uses the same visibility rule as training (``attention.py``)::

    visible[b, t, l] = (q_segment[b, t] == kv_segment[b, l]) and (kv_pos[b, l] <= q_pos[b, t])

Unwritten entries hold segment ``EMPTY = -1``, which equals no query's segment (queries use 0 for
padding and 1.. for documents), so they are invisible to every query without a separate mask.

Keys and values are one stacked buffer per kind, ``[Nl, B, L, K, Dh]`` over the Nl layers, for the
unrolled and the scanned layer stack alike: layer i writes its T new entries at
``(i, :, index)`` with one ``dynamic_update_slice``, so a decode step updates the cache in place
whether i is a Python int or the layer scan's counter.

All rows write at the same entry ``index`` (a traced int32 scalar): a batch of prompts of
different lengths is left-padded, with padding in segment 0 (invisible to the real tokens), so
that every row's next token goes to entry ``P + step``. Writing past ``L`` is a caller error
(``lax.dynamic_update_slice`` would clamp the index); ``Transformer.decode`` rejects a step
longer than the cache, and samplers size the cache as ``P + max_new_tokens``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax import lax

if TYPE_CHECKING:
    from jaxrl.models.model_config import ModelConfig

EMPTY = -1  # segment id of an unwritten entry


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerKV:
    """Layer ``layer``'s view of the cache: the stacked keys and values of every layer, the
    shared entry metadata and the layer index (a Python int, or traced inside a layer scan)."""

    keys_NlBLKDh: jax.Array  # every layer's keys, compute dtype, after RoPE (and q/k norm)
    values_NlBLKDh: jax.Array
    segment_ids_BL: jax.Array  # int32, EMPTY on unwritten entries
    positions_BL: jax.Array  # int32
    index: jax.Array  # int32 scalar: first entry of the tokens being written
    layer: jax.Array  # int32 scalar: which layer of the stack this view reads and writes

    @property
    def keys_BLKDh(self) -> jax.Array:
        """This layer's keys [B, L, K, Dh]."""
        return lax.dynamic_index_in_dim(self.keys_NlBLKDh, self.layer, 0, keepdims=False)

    @property
    def values_BLKDh(self) -> jax.Array:
        """This layer's values [B, L, K, Dh]."""
        return lax.dynamic_index_in_dim(self.values_NlBLKDh, self.layer, 0, keepdims=False)

    def append(self, k_BTKDh: jax.Array, v_BTKDh: jax.Array) -> LayerKV:
        """Write T new keys and values at this layer's entries ``[index, index + T)`` (in place:
        one ``dynamic_update_slice`` into the stacked buffers; index unchanged)."""
        zero = jnp.zeros((), jnp.int32)
        start = (jnp.asarray(self.layer, jnp.int32), zero, self.index, zero, zero)
        return dataclasses.replace(
            self,
            keys_NlBLKDh=lax.dynamic_update_slice(
                self.keys_NlBLKDh, k_BTKDh[None].astype(self.keys_NlBLKDh.dtype), start
            ),
            values_NlBLKDh=lax.dynamic_update_slice(
                self.values_NlBLKDh, v_BTKDh[None].astype(self.values_NlBLKDh.dtype), start
            ),
        )

    def attend(
        self,
        q_BTHDh: jax.Array,
        k_BTKDh: jax.Array,
        v_BTKDh: jax.Array,
        segment_ids_BT: jax.Array,
        positions_BT: jax.Array,
        attention: Callable[..., jax.Array],
        **variant: Any,
    ) -> tuple[jax.Array, LayerKV]:
        """Append the T new keys/values, then ``attention`` of the queries over all L entries
        under the visibility rule: ``(out_BTHDh, updated view)``. ``variant``: the score
        variants (``scale``, ``softcap``, ``window``) passed on to ``attention``."""
        kv = self.append(k_BTKDh, v_BTKDh)
        out_BTHDh = attention(
            q_BTHDh,
            kv.keys_BLKDh,
            kv.values_BLKDh,
            segment_ids_BT,
            kv.segment_ids_BL,
            positions_BT,
            kv.positions_BL,
            **variant,
        )
        return out_BTHDh, kv


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Keys and values of every layer ``[Nl, B, L, K, Dh]`` (one stacked buffer each, for the
    unrolled and the scanned layer stack alike), entry segments/positions, write index."""

    keys: jax.Array  # [Nl, B, L, K, Dh]: layer, row, entry, KV head, head dim
    values: jax.Array  # [Nl, B, L, K, Dh]
    segment_ids_BL: jax.Array  # int32, EMPTY on unwritten entries
    positions_BL: jax.Array  # int32
    index: jax.Array  # int32 scalar: next entry to write

    @classmethod
    def empty(cls, config: ModelConfig, batch: int, length: int) -> KVCache:
        """An all-EMPTY cache of ``length`` entries in the model's compute dtype."""
        shape = (
            config.num_hidden_layers,
            batch,
            length,
            config.num_key_value_heads,
            config.head_dim,
        )
        return cls(
            keys=jnp.zeros(shape, config.dtype),
            values=jnp.zeros(shape, config.dtype),
            segment_ids_BL=jnp.full((batch, length), EMPTY, jnp.int32),
            positions_BL=jnp.zeros((batch, length), jnp.int32),
            index=jnp.zeros((), jnp.int32),
        )

    @property
    def length(self) -> int:
        """L, the static number of entries."""
        return int(self.segment_ids_BL.shape[1])

    def write_entries(self, segment_ids_BT: jax.Array, positions_BT: jax.Array) -> KVCache:
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

    def layer(self, i: int | jax.Array) -> LayerKV:
        """Layer ``i``'s view (call after :meth:`write_entries`)."""
        return LayerKV(
            self.keys,
            self.values,
            self.segment_ids_BL,
            self.positions_BL,
            self.index,
            jnp.asarray(i, jnp.int32),
        )

    def store(self, kv: LayerKV) -> KVCache:
        """The cache holding a layer view's updated keys and values."""
        return dataclasses.replace(self, keys=kv.keys_NlBLKDh, values=kv.values_NlBLKDh)

    def advance(self, num_tokens: int) -> KVCache:
        """The cache with its write index moved past ``num_tokens`` tokens."""
        return dataclasses.replace(self, index=self.index + num_tokens)
