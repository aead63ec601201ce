"""Blockwise (flash) attention in plain JAX that skips the blocks nothing in them can see.

Same inputs, visibility rule and numerics contract as :func:`jaxrl.models.attention.dense.attention`
(scores, softmax statistics and accumulators in float32, matmuls in the operands' dtype), but
the ``[T, L]`` score matrix is never materialised and, more to the point, most of it is never
computed: the rows are cut into query blocks of ``block_q`` tokens and key blocks of
``block_kv`` slots, and only the (query block, key block) pairs that can hold a visible pair
are visited. A packed row of short documents then costs about ``sum_d blocks_d**2 / 2`` block
products instead of ``(T / block)**2``; padding costs nothing (segment 0 sees nothing).

Which pairs to visit (:func:`block_visibility`) is decided from per-block summaries on the
device, never from the token-level mask: for a query block, the range ``[lo, hi]`` of its
document ids, its last document and that document's largest position, and the largest position
of its other documents; for a key block, the same range, its first document with that
document's smallest position, and the smallest position of its other documents. A pair is
visited when some document id in both ranges may have a key position ``<=`` a query position.
The test is conservative (it never drops a visible pair, whatever the layout) and exact for
the layout the packer produces (documents contiguous, ids increasing along the row, positions
increasing within a document): no visited pair is empty of visible entries then.

Each row gets its visible pairs as a list (row-major, sentinel-padded); a ``lax.fori_loop``
runs ``max_rows(count)`` steps and step ``n`` processes every row's ``n``-th pair (rows whose
list is shorter process a fully masked pair), so the work is ``B * max_b count_b`` block
products: rows are batched, never sequential, and sharding over B partitions the loop.

In float32 the forward is one pass of online softmax; with bf16/fp16 operands it takes a
second pass so that, as in the dense reference, *normalised* probabilities are cast to the
operands' dtype before the value product (results then do not depend on block boundaries, i.e.
on where the packer put a document, beyond float32 rounding).

Backward: ``jax.custom_vjp`` with the FlashAttention-2 backward (Dao 2023, Algorithm 2). The
forward keeps only its output and the per-query log-sum-exp; the backward walks the same pair
lists, recomputes each block's probabilities ``exp(s - lse)`` and accumulates
``dv += p^T dO``, ``ds = p * (dO v^T - rowsum(dO * O))``, ``dq += ds k / sqrt(Dh)``,
``dk += ds^T q / sqrt(Dh)`` in float32.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxrl.models.attention.dense import soft_cap, within_window

DEFAULT_BLOCK = 128  # tokens per query block and slots per key block (clamped to T and L)
_BIG = 1 << 30  # larger than any segment id or position
_MASKED = np.float32(-1e30)  # score of an invisible pair: finite, so no inf - inf


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _pad_to(x: jax.Array, length: int, value: int = 0) -> jax.Array:
    """Pad axis 1 of ``x`` to ``length`` with ``value``."""
    pad = [(0, 0)] * x.ndim
    pad[1] = (0, length - x.shape[1])
    return jnp.pad(x, pad, constant_values=value)


def _block_edges(seg_BNbb: jax.Array, pos_BNbb: jax.Array, *, last: bool):
    """Per-block summaries ``(lo, hi, edge_seg, edge_pos, other_pos)`` of ``[B, Nb, b]`` blocks
    (Nb blocks of b tokens).

    ``edge_seg`` is the document of the block's last (``last=True``) or first real token;
    ``edge_pos`` is that document's largest (last) or smallest (first) position in the block,
    ``other_pos`` the largest / smallest position of the block's other documents. Entries with
    no real token hold values that make every comparison fail (``lo > hi``, ``+-_BIG``).
    """
    real = seg_BNbb > 0
    lo = jnp.min(jnp.where(real, seg_BNbb, _BIG), axis=-1)
    hi = jnp.max(jnp.where(real, seg_BNbb, -1), axis=-1)
    idx = jnp.arange(seg_BNbb.shape[-1], dtype=jnp.int32)
    if last:
        at = jnp.max(jnp.where(real, idx, 0), axis=-1)
    else:
        at = jnp.min(jnp.where(real, idx, seg_BNbb.shape[-1] - 1), axis=-1)
    edge_seg = jnp.take_along_axis(seg_BNbb, at[..., None], axis=-1)[..., 0]
    in_edge = real & (seg_BNbb == edge_seg[..., None])
    in_other = real & (seg_BNbb != edge_seg[..., None])
    if last:
        edge_pos = jnp.max(jnp.where(in_edge, pos_BNbb, -_BIG), axis=-1)
        other_pos = jnp.max(jnp.where(in_other, pos_BNbb, -_BIG), axis=-1)
    else:
        edge_pos = jnp.min(jnp.where(in_edge, pos_BNbb, _BIG), axis=-1)
        other_pos = jnp.min(jnp.where(in_other, pos_BNbb, _BIG), axis=-1)
    return lo, hi, edge_seg, edge_pos, other_pos


def block_visibility(
    q_segment_BT: jax.Array,
    kv_segment_BL: jax.Array,
    q_pos_BT: jax.Array,
    kv_pos_BL: jax.Array,
    *,
    block_q: int,
    block_kv: int,
    q_parent_BT: jax.Array | None = None,
    window: int | jax.Array | None = None,
) -> jax.Array:
    """Which (query block, key block) pairs flash attention visits: bool [B, T/bq, L/bk].

    ``T`` and ``L`` must be multiples of the block sizes (``flash_attention`` pads). True for
    every pair that holds a visible (query, key) entry; for contiguous documents with
    increasing ids and positions, true for exactly those (see the module docstring). With
    ``q_parent_BT`` the pairs where a query sees its parent segment are added
    (:func:`_parent_visibility`). With a sliding ``window`` a pair is also dropped when even
    its closest real query and key (smallest query position, largest key position) are
    ``window`` or more positions apart.
    """
    b, t = q_segment_BT.shape
    length = kv_segment_BL.shape[1]
    if t % block_q or length % block_kv:
        raise ValueError(
            f"block_visibility: T={t} and L={length} must be multiples of block_q={block_q} "
            f"and block_kv={block_kv}; flash_attention pads them, call it instead"
        )
    q_seg = q_segment_BT.astype(jnp.int32).reshape(b, t // block_q, block_q)
    q_pos = q_pos_BT.astype(jnp.int32).reshape(q_seg.shape)
    kv_seg = kv_segment_BL.astype(jnp.int32).reshape(b, length // block_kv, block_kv)
    kv_pos = kv_pos_BL.astype(jnp.int32).reshape(kv_seg.shape)
    q_lo, q_hi, q_last, q_last_max, q_other_max = (
        x[:, :, None] for x in _block_edges(q_seg, q_pos, last=True)
    )
    k_lo, k_hi, k_first, k_first_min, k_other_min = (
        x[:, None, :] for x in _block_edges(kv_seg, kv_pos, last=False)
    )
    lo, hi = jnp.maximum(q_lo, k_lo), jnp.minimum(q_hi, k_hi)  # candidate documents

    def inside(s: jax.Array) -> jax.Array:
        return (lo <= s) & (s <= hi)

    # A candidate document s needs min kv position <= max q position; bound both per case.
    first_in = inside(k_first)
    q_max_of_first = jnp.where(k_first == q_last, q_last_max, q_other_max)
    via_first = first_in & (k_first_min <= q_max_of_first)
    last_in = inside(q_last) & (q_last != k_first)
    via_last = last_in & (k_other_min <= q_last_max)
    others = (hi - lo + 1) - first_in.astype(jnp.int32) - last_in.astype(jnp.int32)
    via_other = (others > 0) & (k_other_min <= q_other_max)
    visible = (lo <= hi) & (via_first | via_last | via_other)
    if window is not None:
        q_min = jnp.min(jnp.where(q_seg > 0, q_pos, _BIG), axis=-1)[:, :, None]
        k_max = jnp.max(jnp.where(kv_seg > 0, kv_pos, -_BIG), axis=-1)[:, None, :]
        visible = visible & (q_min - k_max < window)
    if q_parent_BT is None:
        return visible
    q_par = q_parent_BT.astype(jnp.int32).reshape(q_seg.shape)
    k_min = jnp.minimum(k_first_min, k_other_min)
    return visible | _parent_visibility(q_seg, q_par, q_pos, k_lo, k_hi, k_min)


def _parent_visibility(q_seg, q_par, q_pos, k_lo, k_hi, k_min_pos):
    """The (query block, key block) pairs where some query may see its parent segment.

    Query block summaries: the parents of its first and last real query that has one, the range
    of its other parents and the largest position of a query with a parent; key block: the
    range ``[k_lo, k_hi]`` of its documents and its smallest position. A pair is kept when one
    of the parents lies in the key range (the range of the others meets it) and
    ``k_min_pos <= q_max_pos``: conservative for any layout, and exact for shared-prompt rows
    (``[A | B1 | B2 ...]``, every ``Bi`` after its parent ``A``, ids increasing) whose query
    blocks span at most three groups: a parent's positions all precede its children's.
    """
    has = (q_seg > 0) & (q_par > 0)
    idx = jnp.arange(q_seg.shape[-1], dtype=jnp.int32)
    first_at = jnp.min(jnp.where(has, idx, q_seg.shape[-1] - 1), axis=-1, keepdims=True)
    last_at = jnp.max(jnp.where(has, idx, 0), axis=-1, keepdims=True)
    p_first = jnp.take_along_axis(q_par, first_at, axis=-1)  # [B, Nq, 1]
    p_last = jnp.take_along_axis(q_par, last_at, axis=-1)
    other = has & (q_par != p_first) & (q_par != p_last)
    o_lo = jnp.min(jnp.where(other, q_par, _BIG), axis=-1)[:, :, None]
    o_hi = jnp.max(jnp.where(other, q_par, -1), axis=-1)[:, :, None]
    q_max_pos = jnp.max(jnp.where(has, q_pos, -_BIG), axis=-1)[:, :, None]
    any_par = jnp.any(has, axis=-1)[:, :, None]

    def inside(p: jax.Array) -> jax.Array:  # [B, Nq, 1] against [B, 1, Nk]
        return (k_lo <= p) & (p <= k_hi)

    meets = inside(p_first) | inside(p_last)
    meets = meets | (jnp.maximum(o_lo, k_lo) <= jnp.minimum(o_hi, k_hi))
    return any_par & meets & (k_min_pos <= q_max_pos)


def _pair_lists(visible_BNbNb: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per row: query-block and key-block index of its visible pairs (row-major order,
    padded with pair 0) and their count: ``(q_blocks [B, Np], kv_blocks [B, Np], count [B])``."""
    b, nq, nk = visible_BNbNb.shape
    flat_BNp = visible_BNbNb.reshape(b, nq * nk)
    (idx_BNp,) = jax.vmap(lambda row: jnp.nonzero(row, size=nq * nk, fill_value=0))(flat_BNp)
    return (idx_BNp // nk).astype(jnp.int32), (idx_BNp % nk).astype(jnp.int32), flat_BNp.sum(-1)


def _gather_block(x: jax.Array, start_B: jax.Array, size: int) -> jax.Array:
    """Each row's ``x[b, start_B[b] : start_B[b] + size]`` (axis 1)."""
    return jax.vmap(lambda row, s: lax.dynamic_slice_in_dim(row, s, size, axis=0))(x, start_B)


def _add_block(x: jax.Array, start_B: jax.Array, update: jax.Array) -> jax.Array:
    """``x[b, start_B[b] : + update.shape[1]] += update[b]``, in place."""

    def row(xr, s, u):
        cur = lax.dynamic_slice_in_dim(xr, s, u.shape[0], axis=0)
        return lax.dynamic_update_slice_in_dim(xr, cur + u, s, axis=0)

    return jax.vmap(row)(x, start_B, update)


def _set_block(x: jax.Array, start_B: jax.Array, update: jax.Array) -> jax.Array:
    return jax.vmap(lambda xr, s, u: lax.dynamic_update_slice_in_dim(xr, u, s, axis=0))(
        x, start_B, update
    )


def _block_inputs(n, pairs, operands, block_q, block_kv, window=None):
    """Step ``n``'s blocks for every row: q, k, v, visibility [B, bq, bk] and block starts."""
    q_blocks_BNp, kv_blocks_BNp, count_B = pairs
    q_BTKHgDh, k_BLKDh, v_BLKDh, q_seg_BT, kv_seg_BL, q_pos_BT, kv_pos_BL = operands[:7]
    active_B = n < count_B
    qs_B = q_blocks_BNp[:, n] * block_q
    ks_B = kv_blocks_BNp[:, n] * block_kv
    q_seg = _gather_block(q_seg_BT, qs_B, block_q)
    kv_seg = _gather_block(kv_seg_BL, ks_B, block_kv)
    q_pos = _gather_block(q_pos_BT, qs_B, block_q)
    kv_pos = _gather_block(kv_pos_BL, ks_B, block_kv)
    same_BTL = q_seg[:, :, None] == kv_seg[:, None, :]
    if len(operands) > 7:  # parent segments (shared-prompt packing)
        q_par = _gather_block(operands[7], qs_B, block_q)[:, :, None]
        same_BTL = same_BTL | ((q_par > 0) & (q_par == kv_seg[:, None, :]))
    vis_BTL = (
        same_BTL
        & (q_seg[:, :, None] > 0)
        & (kv_pos[:, None, :] <= q_pos[:, :, None])
        & active_B[:, None, None]
    )
    vis_BTL = within_window(vis_BTL, q_pos[:, :, None], kv_pos[:, None, :], window)
    q = _gather_block(q_BTKHgDh, qs_B, block_q)
    k = _gather_block(k_BLKDh, ks_B, block_kv)
    v = _gather_block(v_BLKDh, ks_B, block_kv)
    return q, k, v, vis_BTL[:, None, None], qs_B, ks_B


@dataclasses.dataclass(frozen=True)
class _Variant:
    """The static score variants of ``attention.dense.attention``: ``scale`` (None:
    ``1/sqrt(Dh)``) and ``softcap`` (None: off). The sliding window travels with the token
    metadata (``meta``): a scanned layer stack reads it per layer, traced."""

    scale: float | None = None
    softcap: float | None = None

    def factor(self, head_dim: int) -> np.float32:
        return np.float32(head_dim**-0.5 if self.scale is None else self.scale)


def _scores(q_BTKHgDh: jax.Array, k_BLKDh: jax.Array, variant: _Variant) -> jax.Array:
    """``q k^T / sqrt(Dh)`` (soft-capped) in float32: [B, K, Hg, bq, bk]."""
    scale = variant.factor(q_BTKHgDh.shape[-1])
    s = jnp.einsum("btkgd,blkd->bkgtl", q_BTKHgDh, k_BLKDh, preferred_element_type=jnp.float32)
    return soft_cap(s * scale, variant.softcap)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _SoftmaxStats:
    """Online-softmax state of every query, the forward loop's carry (f32 ``[B, T, K, Hg]``)."""

    m: jax.Array  # running max of the scores
    denom: jax.Array  # running sum of exp(score - m)
    acc: jax.Array | None  # [B, T, K, Hg, Dh] running sum of p · v (one pass); None: two passes


def _forward(operands, pairs, window, block_q, block_kv, variant):
    """Forward: ``(out [B, T, K, Hg, Dh] in q's dtype, lse [B, T, K, Hg] f32)``.

    float32 operands: one pass of online softmax (running max ``m`` and sum ``l``, rescaled
    accumulator). Lower-precision operands: two passes, the first for ``m`` and ``l``, the
    second casting the *normalised* probabilities ``exp(s - m) / l`` to the operands' dtype
    before the value product, as the dense reference does; casting unnormalised ones would make
    bf16 results depend on where block boundaries fall, i.e. on the packing.
    """
    q_BTKHgDh, _, v_BLKDh = operands[:3]
    b, t, kh, g, dh = q_BTKHgDh.shape
    one_pass = v_BLKDh.dtype == jnp.float32
    steps = jnp.max(pairs[2], initial=0)

    def value_product(p_BKHgTL, v):
        p_BKHgTL = p_BKHgTL.astype(v_BLKDh.dtype)
        return jnp.einsum("bkgtl,blkd->btkgd", p_BKHgTL, v, preferred_element_type=jnp.float32)

    def online(n, stats: _SoftmaxStats) -> _SoftmaxStats:
        m, denom = stats.m, stats.denom
        q, k, v, vis, qs_B, _ = _block_inputs(n, pairs, operands, block_q, block_kv, window)
        s_BKHgTL = jnp.where(vis, _scores(q, k, variant), _MASKED)
        m_old = _gather_block(m, qs_B, block_q)  # [B, bq, K, Hg]
        m_new = jnp.maximum(m_old, jnp.moveaxis(jnp.max(s_BKHgTL, axis=-1), 3, 1))
        m_new_BKHgT1 = jnp.moveaxis(m_new, 1, 3)[..., None]
        p_BKHgTL = jnp.where(vis, jnp.exp(s_BKHgTL - m_new_BKHgT1), 0.0)
        correction = jnp.exp(m_old - m_new)  # [B, bq, K, Hg]
        row_sum = jnp.moveaxis(jnp.sum(p_BKHgTL, axis=-1), 3, 1)
        denom_blk = _gather_block(denom, qs_B, block_q) * correction + row_sum
        m, denom = _set_block(m, qs_B, m_new), _set_block(denom, qs_B, denom_blk)
        if not one_pass:
            return _SoftmaxStats(m=m, denom=denom, acc=None)
        acc_blk = _gather_block(stats.acc, qs_B, block_q) * correction[..., None]
        acc = _set_block(stats.acc, qs_B, acc_blk + value_product(p_BKHgTL, v))
        return _SoftmaxStats(m=m, denom=denom, acc=acc)

    m = jnp.full((b, t, kh, g), _MASKED, jnp.float32)
    denom = jnp.zeros((b, t, kh, g), jnp.float32)
    acc = jnp.zeros((b, t, kh, g, dh), jnp.float32)
    init = _SoftmaxStats(m=m, denom=denom, acc=acc if one_pass else None)
    stats = lax.fori_loop(0, steps, online, init)
    m, denom = stats.m, stats.denom
    seen = denom > 0  # a query that sees nothing: zero output, lse 0 (its p is masked anyway)
    safe = jnp.where(seen, denom, 1.0)
    if one_pass:
        acc = stats.acc / safe[..., None]
    else:

        def normalised(n, acc):
            q, k, v, vis, qs_B, _ = _block_inputs(n, pairs, operands, block_q, block_kv, window)
            m_BKHgT1 = jnp.moveaxis(_gather_block(m, qs_B, block_q), 1, 3)[..., None]
            l_BKHgT1 = jnp.moveaxis(_gather_block(safe, qs_B, block_q), 1, 3)[..., None]
            s_BKHgTL = jnp.where(vis, _scores(q, k, variant), _MASKED)
            p_BKHgTL = jnp.where(vis, jnp.exp(s_BKHgTL - m_BKHgT1) / l_BKHgT1, 0.0)
            return _add_block(acc, qs_B, value_product(p_BKHgTL, v))

        acc = lax.fori_loop(0, steps, normalised, acc)
    out = jnp.where(seen[..., None], acc, 0.0).astype(q_BTKHgDh.dtype)
    lse = jnp.where(seen, m + jnp.log(safe), 0.0)
    return out, lse


def _backward(operands, pairs, window, out, lse, d_out, block_q, block_kv, variant):
    """FlashAttention-2 backward over the same pair lists: float32 ``(dq, dk, dv)``. With a
    soft-cap ``c = cap tanh(s / cap)`` the score gradient is ``dc (1 - (c / cap)^2)``."""
    q_BTKHgDh, k_BLKDh, v_BLKDh = operands[:3]
    scale = variant.factor(q_BTKHgDh.shape[-1])
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [B,T,K,Hg]
    dq = jnp.zeros(q_BTKHgDh.shape, jnp.float32)
    dk = jnp.zeros(k_BLKDh.shape, jnp.float32)
    dv = jnp.zeros(v_BLKDh.shape, jnp.float32)

    def step(n, carry):
        dq, dk, dv = carry
        q, k, v, vis, qs_B, ks_B = _block_inputs(n, pairs, operands, block_q, block_kv, window)
        lse_BKHgT1 = jnp.moveaxis(_gather_block(lse, qs_B, block_q), 1, 3)[..., None]
        s_BKHgTL = jnp.where(vis, _scores(q, k, variant), _MASKED)
        p_BKHgTL = jnp.where(vis, jnp.exp(s_BKHgTL - lse_BKHgT1), 0.0)
        do = _gather_block(d_out, qs_B, block_q)  # [B, bq, K, Hg, Dh]
        dv_blk = jnp.einsum(
            "bkgtl,btkgd->blkd", p_BKHgTL.astype(do.dtype), do, preferred_element_type=jnp.float32
        )
        dp = jnp.einsum("btkgd,blkd->bkgtl", do, v, preferred_element_type=jnp.float32)
        delta_BKHgT1 = jnp.moveaxis(_gather_block(delta, qs_B, block_q), 1, 3)[..., None]
        ds = p_BKHgTL * (dp - delta_BKHgT1)
        if variant.softcap is not None:  # through cap * tanh(s / cap)
            tanh_BKHgTL = jnp.where(vis, s_BKHgTL, 0.0) / np.float32(variant.softcap)
            ds = ds * (1.0 - jnp.square(tanh_BKHgTL))  # masked entries: finite, p = 0
        ds = ds.astype(q.dtype)
        dq_blk = jnp.einsum("bkgtl,blkd->btkgd", ds, k, preferred_element_type=jnp.float32)
        dk_blk = jnp.einsum("bkgtl,btkgd->blkd", ds, q, preferred_element_type=jnp.float32)
        return (
            _add_block(dq, qs_B, dq_blk * scale),
            _add_block(dk, ks_B, dk_blk * scale),
            _add_block(dv, ks_B, dv_blk),
        )

    steps = jnp.max(pairs[2], initial=0)
    return lax.fori_loop(0, steps, step, (dq, dk, dv))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _flash(q, k, v, meta, block_q, block_kv, variant):
    """``meta = (tokens, pairs, window)``: ``tokens`` = q/kv segments, q/kv positions (and q
    parents), ``pairs`` = :func:`_pair_lists`, ``window`` an int32 scalar or None;
    ``variant``: :class:`_Variant`."""
    out, _ = _forward((q, k, v, *meta[0]), meta[1], meta[2], block_q, block_kv, variant)
    return out


def _flash_fwd(q, k, v, meta, block_q, block_kv, variant):
    out, lse = _forward((q, k, v, *meta[0]), meta[1], meta[2], block_q, block_kv, variant)
    return out, (q, k, v, meta, out, lse)


def _flash_bwd(block_q, block_kv, variant, residuals, d_out):
    q, k, v, meta, out, lse = residuals
    operands = (q, k, v, *meta[0])
    dq, dk, dv = _backward(operands, meta[1], meta[2], out, lse, d_out, block_q, block_kv, variant)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(
    q_BTHDh: jax.Array,
    k_BLKDh: jax.Array,
    v_BLKDh: jax.Array,
    q_segment_BT: jax.Array,
    kv_segment_BL: jax.Array,
    q_pos_BT: jax.Array,
    kv_pos_BL: jax.Array,
    *,
    block_size: int = DEFAULT_BLOCK,
    q_parent_BT: jax.Array | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    window: int | jax.Array | None = None,
) -> jax.Array:
    """:func:`jaxrl.models.attention.dense.attention`, blockwise, visiting only visible blocks.

    ``block_size`` is clamped to T (query blocks) and L (key blocks); lengths that are not a
    multiple are padded internally with padding tokens (segment 0), which cost nothing.
    ``q_parent_BT``: each query's parent segment (0 = none), which it also sees
    (:func:`jaxrl.models.attention.dense.attention`). ``scale``, ``softcap``, ``window``: its
    score variants (a window also prunes blocks, :func:`block_visibility`).
    """
    b, t, h, dh = q_BTHDh.shape
    length, kv_heads = k_BLKDh.shape[1], k_BLKDh.shape[2]
    if h % kv_heads:
        raise ValueError(f"attention: {h} query heads are not a multiple of {kv_heads} kv heads")
    if block_size < 1:
        raise ValueError(f"flash_attention: block_size={block_size} must be >= 1")
    block_q, block_kv = min(block_size, t), min(block_size, length)
    tp, lp = _round_up(t, block_q), _round_up(length, block_kv)
    q_seg, q_pos = _pad_to(q_segment_BT, tp), _pad_to(q_pos_BT, tp)
    kv_seg, kv_pos = _pad_to(kv_segment_BL, lp), _pad_to(kv_pos_BL, lp)
    meta_seg = tuple(x.astype(jnp.int32) for x in (q_seg, kv_seg, q_pos, kv_pos))
    if window is not None:
        window = jnp.asarray(window, jnp.int32)  # static or a layer scan's (traced)
    blocks = dict(block_q=block_q, block_kv=block_kv, window=window)
    if q_parent_BT is None:
        visible = block_visibility(*meta_seg, **blocks)
    else:
        q_par = _pad_to(q_parent_BT, tp).astype(jnp.int32)
        visible = block_visibility(*meta_seg, **blocks, q_parent_BT=q_par)
        meta_seg = (*meta_seg, q_par)
    meta = (meta_seg, _pair_lists(visible), window)
    q = _pad_to(q_BTHDh, tp).reshape(b, tp, kv_heads, h // kv_heads, dh)
    variant = _Variant(scale=scale, softcap=softcap)
    k, v = _pad_to(k_BLKDh, lp), _pad_to(v_BLKDh, lp)
    out = _flash(q, k, v, meta, block_q, block_kv, variant)
    return out.reshape(b, tp, h, dh)[:, :t]
