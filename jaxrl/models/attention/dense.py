"""Packed causal attention and rotary position embeddings, as pure functions.

Shapes follow the package vocabulary (``jaxrl/__init__.py``); inside attention, ``T`` is the
query length and ``L`` the key/value length (``L == T`` without a KV cache, longer with one).
H query heads share K kv heads in groups of ``Hg = H // K`` (query head ``h = k * Hg + g``, as in
Hugging Face's ``repeat_kv``).

Visibility rule (one rule for training, packing and the KV-cache decode path)::

    visible[b, t, l] = (q_segment[b, t] == kv_segment[b, l]) and (q_segment[b, t] != 0)
                       and (kv_pos[b, l] <= q_pos[b, t])

With an optional per-query parent segment ``q_parent[b, t]`` (0 = none), a query also sees
its parent document (shared-prompt packing: a completion sees its prompt, laid out once per
row; docs/attention.md)::

    visible[b, t, l] = (q_segment[b, t] != 0) and (kv_pos[b, l] <= q_pos[b, t])
                       and (q_segment[b, t] == kv_segment[b, l]
                            or (q_parent[b, t] != 0 and q_parent[b, t] == kv_segment[b, l]))

Without parents (``q_parent=None``) every implementation runs exactly the program of the first
rule.

Segment ids are 1-based documents, 0 is padding: real tokens never see padding and padding
sees nothing, so padding costs no attention work in the blockwise implementations. A query that
sees nothing (padding, or an empty cache row) gets a zero output and zero gradients, never NaN.

Implementations (``model.attention_impl``), equal up to float rounding:
``xla`` (:func:`attention`, the dense reference: fp32 scores ``[B, K, Hg, T, L]``), ``flash``
(``flash_attention.py``: blockwise, skips invisible blocks, any backend), ``splash`` (TPU) and
``pallas_gpu`` (GPU) Pallas kernels (``pallas_attention.py``), and ``auto``, the best one for
the backend; ``attention_dispatch.py`` picks one. docs/attention.md compares them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def positions_from_segments(segment_ids_BT: jax.Array) -> jax.Array:
    """Positions that restart at 0 at every change of segment id along a row (int32 [B, T]).

    Documents must be contiguous runs; padding runs count from 0 like any other run.
    """
    segment_ids_BT = jnp.asarray(segment_ids_BT)
    t = segment_ids_BT.shape[-1]
    idx_BT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), segment_ids_BT.shape)
    starts_BT = jnp.concatenate(
        [
            jnp.ones_like(segment_ids_BT[..., :1], dtype=bool),
            segment_ids_BT[..., 1:] != segment_ids_BT[..., :-1],
        ],
        axis=-1,
    )
    run_start_BT = lax.cummax(jnp.where(starts_BT, idx_BT, 0), axis=segment_ids_BT.ndim - 1)
    return idx_BT - run_start_BT


def rope_inv_freq(
    head_dim: int, theta: float, scaling: Mapping[str, Any] | None = None
) -> np.ndarray:
    """Inverse frequencies ``1 / theta**(2i / Dh)`` (float32 [Dh/2]), with optional llama3 or
    linear scaling.

    The arithmetic mirrors transformers' ``_compute_default_rope_parameters``,
    ``_compute_linear_scaling_rope_parameters`` and ``_compute_llama3_parameters`` step by step
    in float32, so the angles match bit for bit up to the platform's ``pow``.
    """
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (np.float32(1.0) / (np.float32(theta) ** exponent)).astype(np.float32)
    if scaling is None:
        return inv_freq
    if scaling.get("rope_type") == "linear":
        return (inv_freq / np.float32(scaling["factor"])).astype(np.float32)
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = (np.float32(2 * math.pi) / inv_freq).astype(np.float32)
    inv_freq_llama = np.where(wavelen > low_freq_wavelen, inv_freq / np.float32(factor), inv_freq)
    smooth = (np.float32(old_context_len) / wavelen - np.float32(low_freq_factor)) / np.float32(
        high_freq_factor - low_freq_factor
    )
    smoothed = (np.float32(1) - smooth) * inv_freq_llama / np.float32(factor) + (
        smooth * inv_freq_llama
    )
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(is_medium, smoothed, inv_freq_llama).astype(np.float32)


def apply_rope(x_BTHDh: jax.Array, pos_BT: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotary embedding in Hugging Face's rotate-half layout, angles in float32.

    ``x * cos(p w) + rotate_half(x) * sin(p w)`` with ``rotate_half([x1, x2]) = [-x2, x1]`` and
    the frequencies ``w`` repeated over both halves of the head dim.
    """
    # [B, T, Dh/2]: one angle per rotated pair
    half_angle = pos_BT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None]
    angle_BTDh = jnp.concatenate([half_angle, half_angle], axis=-1)
    cos_BT1Dh = jnp.cos(angle_BTDh)[:, :, None, :]
    sin_BT1Dh = jnp.sin(angle_BTDh)[:, :, None, :]
    x32 = x_BTHDh.astype(jnp.float32)
    half = x32.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos_BT1Dh + rotated * sin_BT1Dh).astype(x_BTHDh.dtype)


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    """``cap * tanh(x / cap)`` in x's dtype (transformers' Gemma 2 soft-capping); x if None."""
    if cap is None:
        return x
    cap_ = jnp.asarray(cap, x.dtype)
    return jnp.tanh(x / cap_) * cap_


def within_window(
    visible: jax.Array, q_pos: jax.Array, kv_pos: jax.Array, window: int | None
) -> jax.Array:
    """``visible`` and, with a sliding ``window``, ``q_pos - kv_pos < window`` (transformers'
    ``sliding_window_overlay``: a query sees itself and the ``window - 1`` positions before it).
    Positions restart per document, so a window never reaches into another document."""
    if window is None:
        return visible
    return visible & (q_pos - kv_pos < window)


def attention(
    q_BTHDh: jax.Array,
    k_BLKDh: jax.Array,
    v_BLKDh: jax.Array,
    q_segment_BT: jax.Array,
    kv_segment_BL: jax.Array,
    q_pos_BT: jax.Array,
    kv_pos_BL: jax.Array,
    *,
    q_parent_BT: jax.Array | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    window: int | None = None,
) -> jax.Array:
    """Grouped-query attention under the module's visibility rule; returns [B, T, H, Dh].

    ``softmax(q k^T / sqrt(Dh))`` with scores, mask and softmax in float32; the matmuls take
    the operands' dtype and the probabilities are cast back to it for the value product.
    ``q_parent_BT`` (int [B, T], 0 = none): each query's parent segment, which it also sees.
    Variants: ``scale`` replaces ``1/sqrt(Dh)``, ``softcap`` maps the
    scaled scores to ``softcap * tanh(s / softcap)`` (Gemma 2), ``window`` (sliding-window
    layers) also requires ``q_pos - kv_pos < window``; None: off, the program without them.
    """
    b, t, h, dh = q_BTHDh.shape
    kv_heads = k_BLKDh.shape[2]
    if h % kv_heads:
        raise ValueError(f"attention: {h} query heads are not a multiple of {kv_heads} kv heads")
    q_BTKHgDh = q_BTHDh.reshape(b, t, kv_heads, h // kv_heads, dh)
    scores_BKHgTL = jnp.einsum(
        "btkgd,blkd->bkgtl", q_BTKHgDh, k_BLKDh, preferred_element_type=jnp.float32
    ) * np.float32(dh**-0.5 if scale is None else scale)
    scores_BKHgTL = soft_cap(scores_BKHgTL, softcap)
    same_BTL = q_segment_BT[:, :, None] == kv_segment_BL[:, None, :]
    if q_parent_BT is not None:  # shared-prompt packing: the parent document too
        parent_BT1 = q_parent_BT[:, :, None]
        same_BTL = same_BTL | ((parent_BT1 != 0) & (parent_BT1 == kv_segment_BL[:, None, :]))
    visible_BTL = (
        same_BTL & (q_segment_BT[:, :, None] != 0) & (kv_pos_BL[:, None, :] <= q_pos_BT[:, :, None])
    )
    visible_BTL = within_window(visible_BTL, q_pos_BT[:, :, None], kv_pos_BL[:, None, :], window)
    visible_B11TL = visible_BTL[:, None, None, :, :]
    # A finite fill keeps fully masked rows NaN-free; `where` zeroes their probabilities.
    scores_BKHgTL = jnp.where(visible_B11TL, scores_BKHgTL, np.float32(-1e30))
    probs_BKHgTL = jnp.where(visible_B11TL, jax.nn.softmax(scores_BKHgTL, axis=-1), 0.0)
    out_BTKHgDh = jnp.einsum("bkgtl,blkd->btkgd", probs_BKHgTL.astype(v_BLKDh.dtype), v_BLKDh)
    return out_BTKHgDh.reshape(b, t, h, dh)
