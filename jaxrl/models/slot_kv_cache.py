"""Slot-contiguous KV cache for continuous batching: each decode slot has its own length.

``SlotKVCache`` holds keys and values ``[Nl, Sl, L, K, Dh]`` for Sl decode slots of L entries
each. Slot s holds one sequence at a time, its tokens at entries ``0, 1, 2, ...`` in order, so a
token's position IS its entry index. A decode step writes the new token of slot s at entry
``positions[s]`` (one scatter per layer, in place) and attends over entries ``0..positions[s]``
only. Everything past a slot's position is invisible by causality: entries left over from the
slot's previous sequence (a stopped slot is refilled with the next request without clearing
anything) lie at larger positions, and each is overwritten before it becomes visible. No per-entry
segment or position metadata is needed. A session (``generate/session.py``) appends several
tokens to a live slot at once (T > 1 in :meth:`SlotLayerKV.attend`).

Decode attention (:func:`decode_attention`) walks the keys in blocks of ``block`` entries and
stops at the block holding the longest live position: a step's matmuls over keys and values
cost the live lengths, not L (only a float32 softmax over ``[Sl, H, L]`` scores spans the whole
row). Entries past a slot's position are masked exactly as the dense path masks them, so the
result does not depend on how many blocks the longest slot made the loop run. Only decoding (one
new token per slot) goes through this cache; prompts are prefilled with ``kv_cache.KVCache`` and
their keys copied in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxrl.models.attention.dense import soft_cap, within_window

if TYPE_CHECKING:
    from jaxrl.models.model_config import ModelConfig

DECODE_BLOCK = 64  # entries per decode-attention block (the sampler's default)
_MASKED = np.float32(-1e30)  # the dense path's fill for invisible scores (attention.py)


def decode_attention(
    q_BHDh: jax.Array,
    keys_NlBLKDh: jax.Array,
    values_NlBLKDh: jax.Array,
    layer: jax.Array,
    positions_B: jax.Array,
    block: int,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    window: int | None = None,
) -> jax.Array:
    """One query per row over entries ``0..positions[b]`` of layer ``layer``: ``[B, H, Dh]``.

    ``scale``, ``softcap`` and a sliding ``window`` (entries ``positions[b] - window + 1..``
    only): the score variants of ``attention.dense.attention``. With a window the loop still
    starts at block 0 (the cache keeps every entry; no ring buffer yet, docs/models.md).

    The dtype path of ``attention.attention``: float32 scores, a float32 softmax over the row,
    probabilities cast to the values' dtype for the value product. Two passes over the blocks
    up to the longest position (``max(positions) // block + 1`` of them): scores into a float32
    row ``[B, K, Hg, L]`` (masked entries stay ``-1e30``, exactly as the dense path masks
    them), one softmax, then the value product block by block, accumulated in float32.
    """
    b, h, dh = q_BHDh.shape
    _, _, length, kv_heads, _ = keys_NlBLKDh.shape
    hg = h // kv_heads
    q_BKHgDh = q_BHDh.reshape(b, kv_heads, hg, dh)
    scale = np.float32(dh**-0.5 if scale is None else scale)
    num_blocks = jnp.minimum(jnp.max(positions_B) // block + 1, length // block)

    def block_of(buf, j):
        return lax.dynamic_slice(buf, (layer, 0, j * block, 0, 0), (1, b, block, kv_heads, dh))[0]

    def scores(j, s_BKHgL):
        s_BKHgb = jnp.einsum(
            "bkgd,bjkd->bkgj", q_BKHgDh, block_of(keys_NlBLKDh, j),
            preferred_element_type=jnp.float32,
        ) * scale  # fmt: skip
        s_BKHgb = soft_cap(s_BKHgb, softcap)
        entry_b = (j * block + jnp.arange(block))[None, :]
        visible_Bb = within_window(entry_b <= positions_B[:, None], positions_B[:, None], entry_b,
                                   window)  # fmt: skip
        s_BKHgb = jnp.where(visible_Bb[:, None, None, :], s_BKHgb, _MASKED)
        return lax.dynamic_update_slice_in_dim(s_BKHgL, s_BKHgb, j * block, axis=3)

    s_BKHgL = lax.fori_loop(
        0, num_blocks, scores, jnp.full((b, kv_heads, hg, length), _MASKED, jnp.float32)
    )
    entry_L = jnp.arange(length)[None, :]
    visible_BL = within_window(
        entry_L <= positions_B[:, None], positions_B[:, None], entry_L, window
    )
    p_BKHgL = jnp.where(visible_BL[:, None, None, :], jax.nn.softmax(s_BKHgL, axis=-1), 0.0).astype(
        values_NlBLKDh.dtype
    )

    def values(j, acc_BKHgDh):
        p_BKHgb = lax.dynamic_slice_in_dim(p_BKHgL, j * block, block, axis=3)
        return acc_BKHgDh + jnp.einsum(
            "bkgj,bjkd->bkgd", p_BKHgb, block_of(values_NlBLKDh, j),
            preferred_element_type=jnp.float32,
        )  # fmt: skip

    acc_BKHgDh = lax.fori_loop(0, num_blocks, values, jnp.zeros((b, kv_heads, hg, dh), jnp.float32))
    return acc_BKHgDh.reshape(b, h, dh).astype(q_BHDh.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotLayerKV:
    """Layer ``layer``'s view of a :class:`SlotKVCache` during one decode step."""

    keys_NlBLKDh: jax.Array
    values_NlBLKDh: jax.Array
    layer: jax.Array  # int32 scalar (a Python int, or traced inside a layer scan)
    block: int = dataclasses.field(metadata=dict(static=True))

    def attend(
        self,
        q_BTHDh: jax.Array,
        k_BTKDh: jax.Array,
        v_BTKDh: jax.Array,
        segment_ids_BT: jax.Array,
        positions_BT: jax.Array,
        attention: Callable[..., jax.Array],
        **variant: Any,
    ) -> tuple[jax.Array, SlotLayerKV]:
        """Write each row's one new key/value at entry ``positions[b]``, then
        :func:`decode_attention` (``attention`` and ``segment_ids`` are not used: a slot holds
        one sequence). T > 1 new tokens per row (a session appending tokens to live slots,
        ``generate/session.py``): row b's token t is written at entry ``positions[b, t]``
        (entries past L are dropped) and attends, through ``attention``, to the row's entries
        ``0..positions[b, t]``; tokens of segment 0 (padding) attend to nothing. ``variant``:
        the score variants (``scale``, ``softcap``, ``window``), passed on."""
        b, t = q_BTHDh.shape[:2]
        layer = jnp.asarray(self.layer, jnp.int32)
        if t > 1:
            rows_B1 = jnp.arange(b)[:, None]
            keys = self.keys_NlBLKDh.at[layer, rows_B1, positions_BT].set(
                k_BTKDh.astype(self.keys_NlBLKDh.dtype), mode="drop"
            )
            values = self.values_NlBLKDh.at[layer, rows_B1, positions_BT].set(
                v_BTKDh.astype(self.values_NlBLKDh.dtype), mode="drop"
            )
            length = keys.shape[2]
            kv_pos_BL = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length))
            out_BTHDh = attention(
                q_BTHDh,
                lax.dynamic_index_in_dim(keys, layer, 0, keepdims=False),
                lax.dynamic_index_in_dim(values, layer, 0, keepdims=False),
                segment_ids_BT,
                jnp.ones((b, length), jnp.int32),
                positions_BT,
                kv_pos_BL,
                **variant,
            )
            return out_BTHDh, dataclasses.replace(self, keys_NlBLKDh=keys, values_NlBLKDh=values)
        del segment_ids_BT, attention
        pos_B = positions_BT[:, 0]
        rows_B = jnp.arange(b)
        keys = self.keys_NlBLKDh.at[layer, rows_B, pos_B].set(
            k_BTKDh[:, 0].astype(self.keys_NlBLKDh.dtype), mode="promise_in_bounds"
        )
        values = self.values_NlBLKDh.at[layer, rows_B, pos_B].set(
            v_BTKDh[:, 0].astype(self.values_NlBLKDh.dtype), mode="promise_in_bounds"
        )
        out_BHDh = decode_attention(
            q_BTHDh[:, 0], keys, values, layer, pos_B, self.block, **variant
        )
        return out_BHDh[:, None], dataclasses.replace(
            self, keys_NlBLKDh=keys, values_NlBLKDh=values
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotKVCache:
    """Keys and values ``[Nl, Sl, L, K, Dh]`` of Sl decode slots; L a multiple of ``block``."""

    keys: jax.Array
    values: jax.Array
    block: int = dataclasses.field(metadata=dict(static=True))

    @classmethod
    def empty(cls, config: ModelConfig, slots: int, length: int, block: int) -> SlotKVCache:
        """Zeros in the compute dtype; ``length`` is rounded up to a multiple of ``block``."""
        length = -(-length // block) * block
        shape = (config.num_hidden_layers, slots, length, config.num_key_value_heads,
                 config.head_dim)  # fmt: skip
        zeros = jnp.zeros(shape, config.dtype)
        return cls(keys=zeros, values=zeros, block=block)

    @staticmethod
    def nbytes(config: ModelConfig, slots: int, length: int, block: int) -> int:
        """Bytes of a cache :meth:`empty` would allocate (keys and values)."""
        length = -(-length // block) * block
        per = config.num_hidden_layers * length * config.num_key_value_heads * config.head_dim
        return 2 * slots * per * np.dtype(config.dtype).itemsize

    @property
    def length(self) -> int:
        """L, the entries per slot."""
        return int(self.keys.shape[2])

    def write_entries(self, segment_ids_BT: jax.Array, positions_BT: jax.Array) -> SlotKVCache:
        """Nothing to record: an entry's position is its index (``Transformer.decode`` hook)."""
        return self

    def layer(self, i: int | jax.Array) -> SlotLayerKV:
        return SlotLayerKV(self.keys, self.values, jnp.asarray(i, jnp.int32), self.block)

    def store(self, kv: SlotLayerKV) -> SlotKVCache:
        return dataclasses.replace(self, keys=kv.keys_NlBLKDh, values=kv.values_NlBLKDh)

    def advance(self, num_tokens: int) -> SlotKVCache:
        """Unchanged: each slot's write position comes with its token."""
        return self

    def fill_prompts(
        self, prompt_keys: jax.Array, prompt_values: jax.Array, start_B: jax.Array,
        refill_B: jax.Array, length: int = 0,
    ) -> SlotKVCache:  # fmt: skip
        """Slots where ``refill_B`` get entries ``[0, P)`` from a prompt cache ``[Nl, R, W, K, Dh]``
        (a prefill of prompts packed in rows): its entries ``start_B[s], start_B[s] + 1, ...`` in
        the flat ``row * W + column`` order; P = ``length`` (0: W). Entries past a prompt's end
        come from whatever follows it (padding, another prompt): they lie past the slot's
        length, invisible until overwritten. Other slots are unchanged."""
        nl, r, w, k, dh = prompt_keys.shape
        p = length or w
        idx_BP = jnp.clip(start_B[:, None] + jnp.arange(p)[None, :], 0, r * w - 1)

        def fill(buf, prompt):
            head = lax.slice_in_dim(buf, 0, p, axis=2)
            new = jnp.take(prompt.reshape(nl, r * w, k, dh), idx_BP, axis=1)
            head = jnp.where(refill_B[None, :, None, None, None], new.astype(buf.dtype), head)
            return lax.dynamic_update_slice_in_dim(buf, head, 0, axis=2)

        return dataclasses.replace(
            self, keys=fill(self.keys, prompt_keys), values=fill(self.values, prompt_values)
        )
