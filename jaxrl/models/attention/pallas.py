"""Pallas attention kernels behind ``attention_impl``: TPU ``splash`` and GPU ``pallas_gpu``.

Both are JAX's own kernels (``jax.experimental.pallas.ops``) with segment ids; this module
adapts them to :func:`jaxrl.models.attention.dense.attention`'s signature and visibility rule.

The kernels mask causally by *index* (key index <= query index), the rule by *position*
(key position <= query position, same document). The two agree on self-attention (T == L,
the same segment ids and positions for queries and keys) when, in every row, each document is
one contiguous run among the real tokens (real segment ids never decrease along the row;
padding may sit anywhere) and positions strictly increase from one real token to the next in
the same document. The packer and the sampler produce exactly that (positions restart per
document). :func:`index_causal_matches` checks it on device, and when a batch breaks it, the
call runs the dense reference instead (``lax.cond``: one branch executes), so results never
depend on the layout. Padding queries (segment 0), which the kernels let see padding, are
zeroed afterwards, as the rule wants (their gradient is zero too).

Known limits: parent segments (``q_parent_BT``, shared-prompt packing) are not a mask JAX's
kernels can express (they only compare segment ids for equality), so a call with parents runs
the blockwise ``flash`` implementation (``flash.py``) instead, on any backend; a Pallas fast
path for parents is future work (docs/attention.md). Score variants (docs/models.md): a custom
``scale`` (Gemma's ``query_pre_attn_scalar``) runs in both kernels; splash also takes Gemma 2's
``softcap`` (its ``attn_logits_soft_cap``) and a static sliding ``window`` (its ``LocalMask``,
by index: the fallback test then also requires consecutive positions within each document);
``pallas_gpu`` runs ``flash`` for those.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxrl.models.attention.dense import attention
from jaxrl.models.attention.flash import flash_attention

_LANES = 128  # splash blocks are multiples of the TPU lane width
_WARP_BLOCK = 32  # pallas_gpu blocks are multiples of its backward block (jax's default, 32)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def index_causal_matches(
    q_segment_BT: jax.Array,
    kv_segment_BL: jax.Array,
    q_pos_BT: jax.Array,
    kv_pos_BL: jax.Array,
    *,
    consecutive: bool = False,
) -> jax.Array:
    """Scalar bool: index-causal masking with segment ids equals the position rule here.

    True when queries and keys carry the same segments and positions, real segment ids never
    decrease along a row, and positions strictly increase between consecutive real tokens of
    the same document (module docstring). ``consecutive`` (a sliding window, which the kernel
    applies by index): positions also advance exactly as the indices do within a document
    (no padding inside a document, no gaps), so index distances are position distances.
    """
    if q_segment_BT.shape != kv_segment_BL.shape:
        return jnp.asarray(False)
    same = jnp.all(q_segment_BT == kv_segment_BL) & jnp.all(q_pos_BT == kv_pos_BL)
    seg, pos = q_segment_BT.astype(jnp.int32), q_pos_BT.astype(jnp.int32)
    real = seg > 0
    idx = jnp.broadcast_to(jnp.arange(seg.shape[1], dtype=jnp.int32), seg.shape)
    last_real = lax.cummax(jnp.where(real, idx, -1), axis=1)
    prev = jnp.concatenate([jnp.full_like(last_real[:, :1], -1), last_real[:, :-1]], axis=1)
    has_prev = real & (prev >= 0)
    prev_seg = jnp.take_along_axis(seg, jnp.maximum(prev, 0), axis=1)
    prev_pos = jnp.take_along_axis(pos, jnp.maximum(prev, 0), axis=1)
    ordered = ~has_prev | (seg > prev_seg) | ((seg == prev_seg) & (pos > prev_pos))
    if consecutive:
        steps = (seg != prev_seg) | (pos - prev_pos == idx - prev)
        ordered = ordered & (~has_prev | steps)
    return same & jnp.all(ordered)


def _with_fallback(kernel, q, k, v, q_seg, kv_seg, q_pos, kv_pos, **variant):
    """``kernel`` where the index rule matches the position rule, else the dense reference
    (with the same score ``variant``); padding queries zeroed either way."""
    if q.shape[1] != k.shape[1]:
        raise ValueError(
            f"the Pallas attention kernels need self-attention (T == L), got T={q.shape[1]} "
            f"and L={k.shape[1]}; the KV-cache path uses attention_fn(..., self_attention=False)"
        )
    consecutive = variant.get("window") is not None
    ok = index_causal_matches(q_seg, kv_seg, q_pos, kv_pos, consecutive=consecutive)
    kernel = _manual_over_rest(kernel, q.shape[0], q.shape[2], k.shape[2])
    out = lax.cond(
        ok,
        lambda q, k, v: kernel(q, k, v, q_seg.astype(jnp.int32)),
        lambda q, k, v: attention(q, k, v, q_seg, kv_seg, q_pos, kv_pos, **variant),
        q,
        k,
        v,
    )
    return jnp.where((q_seg != 0)[:, :, None, None], out, jnp.zeros((), out.dtype))


def _manual_over_rest(kernel, batch: int, heads: int, kv_heads: int):
    """``kernel(q, k, v, seg)`` made manual over the mesh axes the caller leaves automatic.

    A Mosaic (TPU Pallas) kernel cannot be partitioned by XLA: inside the train step's or the
    scorer's ``shard_map`` (manual over the batch axes) the ``tensor`` axis is still automatic,
    and lowering for a TPU refuses the call ("Mosaic kernels cannot be automatically
    partitioned"). So the call runs in a nested ``shard_map`` over those axes: heads split over
    ``tensor`` (where both head counts divide), rows over a batch axis left automatic, anything
    else replicated. Outside a mesh, or with every axis manual, ``kernel`` itself."""
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return kernel
    types = zip(mesh.axis_names, mesh.axis_types, strict=True)
    rest = [a for a, t in types if t != AxisType.Manual]
    if not rest or len(rest) == len(mesh.axis_names):  # all manual, or XLA partitions it all
        return kernel
    size = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    head_axis = "tensor" if "tensor" in rest and heads % size["tensor"] == 0 else None
    if head_axis and kv_heads % size[head_axis]:
        head_axis = None
    rows = [a for a in ("data", "fsdp") if a in rest and size[a] > 1]
    row_axes = tuple(rows) if rows and batch % math.prod(size[a] for a in rows) == 0 else None
    qkv = P(row_axes, None, head_axis, None)
    return jax.shard_map(
        kernel,
        mesh=mesh,
        in_specs=(qkv, qkv, qkv, P(row_axes, None)),
        out_specs=qkv,
        axis_names=set(rest),
        check_vma=False,
    )


def _flash_for_parents(*native: str):
    """Decorator: the Pallas attention ``kernel_fn`` (its ``block_size`` / ``interpret`` and
    the ``native`` score variants as keywords), or the blockwise ``flash`` implementation for
    calls with parent segments (shared-prompt packing: JAX's kernels only know segment
    equality, module docstring), with a variant the kernel lacks, or with a traced window (a
    scanned stack's per-layer table: the kernel's mask is static)."""
    return lambda kernel_fn: _dispatch(kernel_fn, native)


def _dispatch(kernel_fn, native: tuple[str, ...]):
    def run(
        q_BTHDh, k_BLKDh, v_BLKDh, q_segment_BT, kv_segment_BL, q_pos_BT, kv_pos_BL,
        *, block_size: int = 128, interpret: bool = False, q_parent_BT: jax.Array | None = None,
        scale: float | None = None, softcap: float | None = None, window: int | None = None,
    ) -> jax.Array:  # fmt: skip
        args = (q_BTHDh, k_BLKDh, v_BLKDh, q_segment_BT, kv_segment_BL, q_pos_BT, kv_pos_BL)
        variant = dict(scale=scale, softcap=softcap, window=window)
        foreign = [k for k, v in variant.items() if v is not None and k not in native]
        if q_parent_BT is not None or foreign or isinstance(window, jax.Array):
            return flash_attention(*args, block_size=block_size, q_parent_BT=q_parent_BT, **variant)
        kept = {k: v for k, v in variant.items() if k in native}
        return kernel_fn(*args, block_size=block_size, interpret=interpret, **kept)

    run.__name__, run.__qualname__, run.__doc__ = (
        kernel_fn.__name__,
        kernel_fn.__qualname__,
        kernel_fn.__doc__,
    )
    return run


def _pad_tokens(x: jax.Array, length: int, value: int = 0) -> jax.Array:
    pad = [(0, 0)] * x.ndim
    pad[1] = (0, length - x.shape[1])
    return jnp.pad(x, pad, constant_values=value)


@_flash_for_parents("scale", "softcap", "window")
def splash(
    q_BTHDh: jax.Array,
    k_BLKDh: jax.Array,
    v_BLKDh: jax.Array,
    q_segment_BT: jax.Array,
    kv_segment_BL: jax.Array,
    q_pos_BT: jax.Array,
    kv_pos_BL: jax.Array,
    *,
    block_size: int = 128,
    interpret: bool = False,
    scale: float | None = None,
    softcap: float | None = None,
    window: int | None = None,
) -> jax.Array:
    """TPU splash attention (causal mask + ``SegmentIds``, GQA) under the visibility rule.

    Blocks are ``block_size`` rounded down to a multiple of 128 (at least 128); T is padded
    to a multiple of the block with tokens of segment -1 (each sees only itself, so no row of
    the kernel's mask is empty). Queries are scaled by ``1/sqrt(Dh)`` (or ``scale``) before the
    kernel; ``softcap`` is the kernel's ``attn_logits_soft_cap`` and a sliding ``window`` its
    ``LocalMask`` (the last ``window`` indices), which equals the position rule when positions
    are consecutive within each document (checked, else the dense reference runs).
    """
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    b, t, h, dh = q_BTHDh.shape
    block = max(_LANES, block_size // _LANES * _LANES)
    tp = _round_up(t, block)

    def kernel(q, k, v, seg):
        seg = _pad_tokens(seg, tp, -1)
        factor = np.float32(dh**-0.5 if scale is None else scale)
        q = (_pad_tokens(q, tp).astype(jnp.float32) * factor).astype(q.dtype)
        q_BHTDh = jnp.swapaxes(q, 1, 2)
        k_BKTDh, v_BKTDh = (jnp.swapaxes(_pad_tokens(x, tp), 1, 2) for x in (k, v))
        if window is None:
            one = sm.CausalMask((tp, tp))
        else:
            one = sm.LocalMask((tp, tp), window_size=(window - 1, 0), offset=0)
        mask = sm.MultiHeadMask([one for _ in range(h)])
        sizes = sk.BlockSizes(
            block_q=block,
            block_kv=block,
            block_kv_compute=block,
            block_q_dkv=block,
            block_kv_dkv=block,
            block_kv_dkv_compute=block,
            block_q_dq=block,
            block_kv_dq=block,
        )
        splash_kernel = sk.make_splash_mha(
            mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret,
            attn_logits_soft_cap=softcap,
        )  # fmt: skip
        segment_ids = sk.SegmentIds(q=seg, kv=seg)
        out_BHTDh = jax.vmap(splash_kernel)(q_BHTDh, k_BKTDh, v_BKTDh, segment_ids=segment_ids)
        return jnp.swapaxes(out_BHTDh, 1, 2)[:, :t].astype(q_BTHDh.dtype)

    return _with_fallback(
        kernel, q_BTHDh, k_BLKDh, v_BLKDh, q_segment_BT, kv_segment_BL, q_pos_BT, kv_pos_BL,
        scale=scale, softcap=softcap, window=window,
    )  # fmt: skip


@_flash_for_parents("scale")
def pallas_gpu(
    q_BTHDh: jax.Array,
    k_BLKDh: jax.Array,
    v_BLKDh: jax.Array,
    q_segment_BT: jax.Array,
    kv_segment_BL: jax.Array,
    q_pos_BT: jax.Array,
    kv_pos_BL: jax.Array,
    *,
    block_size: int = 128,
    interpret: bool = False,
    scale: float | None = None,
) -> jax.Array:
    """GPU (Triton) flash attention ``pallas.ops.gpu.attention.mha``, causal + segment ids.

    The kernel has no grouped-query support, so kv heads are repeated to H (their gradients
    sum back through the repeat). Forward blocks are ``block_size`` rounded down to a multiple
    of 32 (at most T rounded up to 32), backward blocks 32; T is padded to a multiple of the
    block with tokens of segment -1 (each sees only itself).
    """
    from jax.experimental.pallas.ops.gpu import attention as gpu_attention

    b, t, h, dh = q_BTHDh.shape
    kv_heads = k_BLKDh.shape[2]
    block = min(
        max(_WARP_BLOCK, block_size // _WARP_BLOCK * _WARP_BLOCK), _round_up(t, _WARP_BLOCK)
    )
    tp = _round_up(t, block)
    backward = _WARP_BLOCK
    sizes = gpu_attention.BlockSizes(
        block_q=block,
        block_k=block,
        block_q_dkv=backward,
        block_kv_dkv=backward,
        block_q_dq=backward,
        block_kv_dq=backward,
    )

    def kernel(q, k, v, seg):
        k, v = (jnp.repeat(x, h // kv_heads, axis=2) for x in (k, v))
        q, k, v = (_pad_tokens(x, tp) for x in (q, k, v))
        out = gpu_attention.mha(
            q,
            k,
            v,
            _pad_tokens(seg, tp, -1),
            sm_scale=float(dh**-0.5 if scale is None else scale),
            causal=True,
            block_sizes=sizes,
            interpret=interpret,
        )
        return out[:, :t]

    return _with_fallback(
        kernel, q_BTHDh, k_BLKDh, v_BLKDh, q_segment_BT, kv_segment_BL, q_pos_BT, kv_pos_BL,
        scale=scale,
    )  # fmt: skip
