"""ZeRO-3 weights: parameters held as fsdp shards inside ``shard_map``, gathered where used.

Inside the engine's ``shard_map`` (``jaxrl.train.accumulate``, ``jaxrl.train.score``), manual
over the batch axes, every parameter split over ``fsdp`` arrives as the device's shard. The
engine marks each such Variable with :data:`GATHER` metadata ``(mesh axis, dimension)`` (the
dimension counted from the end, so a scanned layer's slice inside the layer ``scan`` keeps it);
the model reads every weight through :func:`weight`, which returns the Variable's value
unchanged when it is unmarked (every program outside the engine, and fsdp = 1) and otherwise
all-gathers it over the axis at its point of use:

- **forward**: ``all_gather`` of the shard already cast to the dtype it is used in (the compute
  dtype for kernels, fp32 for norm scales and the fp32 LM head), so the gathered layer costs
  what the model computes with, not what the optimizer stores;
- **backward** (``custom_vjp``): the cotangent of the gathered weight is cast to fp32 and
  reduce-scattered (``psum_scatter``) over the axis into the shard, as PyTorch FSDP does: the
  gradient that reaches the parameter is already summed over the fsdp ranks and never exists
  whole on one device.

Inside the scanned layer stack the gather runs in the scan body, one layer at a time; under
``jax.checkpoint`` the gathered value is never a residual (:func:`exclude_gathered` wraps a
remat policy; with ``remat: block`` nothing but the block's input is saved), so the backward
pass gathers each layer again instead of keeping the whole model.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

GATHER = "fsdp_gather"  # Variable metadata: (mesh axis name, dimension counted from the end)
GATHERED_NAME = "fsdp_gathered"  # jax.ad_checkpoint name of every gathered weight


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def mark_sharded(tree: Any, dims: list[int | None], axis: str) -> Any:
    """``tree`` (a State of Variables holding local shards) with every Variable whose entry in
    ``dims`` (one per leaf, in ``jax.tree.leaves`` order: the dimension split over ``axis``, or
    None) is not None marked for gathering."""
    leaves, treedef = jax.tree.flatten(tree, is_leaf=_is_variable)
    if len(leaves) != len(dims):
        raise ValueError(f"mark_sharded: {len(dims)} dims for a tree of {len(leaves)} leaves")

    def mark(v: Any, dim: int | None) -> Any:
        if dim is None or not _is_variable(v):
            return v
        return v.replace(v.get_value(), **{GATHER: (axis, dim - v.get_value().ndim)})

    return jax.tree.unflatten(treedef, [mark(v, d) for v, d in zip(leaves, dims, strict=True)])


def is_marked(variable: Any) -> bool:
    """Whether ``variable`` is a ZeRO-3 shard that :func:`weight` gathers."""
    return _is_variable(variable) and GATHER in variable.get_metadata()


def any_marked(tree: Any) -> bool:
    """Whether any Variable of ``tree`` is marked by :func:`mark_sharded`."""
    leaves = jax.tree.leaves(tree, is_leaf=_is_variable)
    return any(is_marked(v) for v in leaves)


def weight(variable: Any, dtype: Any = None) -> jax.Array:
    """The value of ``variable`` (an ``nnx.Variable`` or an object with ``gathered(dtype)``, such
    as a quantised kernel) in ``dtype`` (None: its own): gathered over its fsdp axis when it is
    marked (:func:`mark_sharded`), else read as it is. Casting before the gather is exact (a
    cast is elementwise)."""
    if not _is_variable(variable):
        return variable.gathered(dtype)
    value = variable.get_value()
    target = value.dtype if dtype is None else jnp.dtype(dtype)
    mark = variable.get_metadata().get(GATHER)
    if mark is None:
        return value.astype(target)
    axis, dim_from_end = mark
    dim = value.ndim + dim_from_end
    if not jnp.issubdtype(value.dtype, jnp.floating):  # quantised codes: never differentiated
        return jax.lax.all_gather(value.astype(target), axis, axis=dim, tiled=True)
    gathered = _gather(value, axis, dim, target, value.dtype)
    return checkpoint_name(gathered, GATHERED_NAME)


def vocab_axis(variable: Any, vocab_dim: int) -> str | None:
    """The mesh axis over which ``variable`` (an embedding ``[V, D]`` or LM head ``[D, V]``) is a
    ZeRO-3 shard of its vocabulary dimension ``vocab_dim`` (counted from the end); None when it
    is not marked. Marked over another dimension is an error: the rules split only the
    vocabulary of these two (``sharding.py``)."""
    mark = variable.get_metadata().get(GATHER) if _is_variable(variable) else None
    if mark is None:
        return None
    if mark[1] != vocab_dim:
        raise ValueError(f"{GATHER}={mark}: the vocabulary dimension is {vocab_dim}")
    return mark[0]


HEAD_VALUES = 1 << 27  # values a vocabulary-parallel head chunk gathers at once
LOOKUP_WHOLE, LOOKUP_VALUES = 1 << 31, 1 << 29  # the lookup: in one piece up to the first,
# above it in chunks of the second (measured on the CPU compiler: one piece is cheaper as long
# as it fits, 72B on fsdp=64; fsdp=128 needs the chunks)


def rows_per_chunk(axis: str, width: int, tokens: int, values: int = HEAD_VALUES) -> int:
    """Tokens per rank in one vocabulary-parallel chunk: every rank handles all ranks' tokens of
    a chunk (``[Rf · C, width]``), so the chunk shrinks as the axis grows, keeping that under
    ``values`` values (at least 16 tokens, at most ``tokens``)."""
    return max(16, min(tokens, values // (jax.lax.axis_size(axis) * width)))


def embed(table: Any, ids_BT: jax.Array, dtype: Any) -> jax.Array:
    """``take(table, ids, mode="clip").astype(dtype)`` for a table marked as a ZeRO-3 shard of its
    vocabulary (rank r holds rows ``[r Vl, (r + 1) Vl)``), without gathering the table: the
    ranks' ids are gathered, each rank looks up the rows it holds (zeros elsewhere) and a
    reduce-scatter returns each rank its own tokens, each the sum of one row and zeros (exact).
    Past ``LOOKUP_WHOLE`` values, tokens go :func:`rows_per_chunk` at a time (the rows of every
    rank's tokens are live at once). The lookup reads the stored (fp32) shard, so the backward
    pass scatter-adds the gradient into it as the unsharded lookup does: never dense on one
    device."""
    axis = vocab_axis(table, -2)
    value = table.get_value()
    rank, v_local = jax.lax.axis_index(axis), value.shape[0]
    b, t = ids_BT.shape
    ids_BT = jnp.clip(ids_BT, 0, v_local * jax.lax.axis_size(axis) - 1)
    chunk = t
    if jax.lax.axis_size(axis) * b * t * value.shape[1] > LOOKUP_WHOLE:
        chunk = rows_per_chunk(axis, value.shape[1], t, LOOKUP_VALUES)
    n = -(-t // chunk)
    # summed in float32 (exact: one row and zeros): a bf16 reduce-scatter aborts XLA:CPU's
    # all-reduce-promotion pass (it cannot clone the reducer), so a bf16 master's rows are cast
    summed = jnp.promote_types(value.dtype, jnp.float32)
    ids_NcBC = jnp.pad(ids_BT, ((0, 0), (0, n * chunk - t))).reshape(b, n, chunk).swapaxes(0, 1)

    def lookup(ids_BC: jax.Array) -> jax.Array:
        local_RfBC = jax.lax.all_gather(ids_BC, axis, axis=0) - rank * v_local
        inside_RfBC = (local_RfBC >= 0) & (local_RfBC < v_local)
        rows_RfBCD = jnp.take(value, jnp.clip(local_RfBC, 0, v_local - 1), axis=0)
        rows_RfBCD = jnp.where(inside_RfBC[..., None], rows_RfBCD, 0).astype(summed)
        return jax.lax.psum_scatter(rows_RfBCD, axis, scatter_dimension=0, tiled=True)[0]

    x_NcBCD = jax.lax.map(lookup, ids_NcBC) if n > 1 else lookup(ids_NcBC[0])[None]
    return x_NcBCD.swapaxes(0, 1).reshape(b, n * chunk, -1)[:, :t].astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _gather(shard: jax.Array, axis: str, dim: int, dtype: Any, shard_dtype: Any) -> jax.Array:
    return jax.lax.all_gather(shard.astype(dtype), axis, axis=dim, tiled=True)


def _gather_fwd(shard, axis, dim, dtype, shard_dtype):
    return _gather(shard, axis, dim, dtype, shard_dtype), None


def _gather_bwd(axis, dim, dtype, shard_dtype, _, cotangent):
    summed = jax.lax.psum_scatter(
        cotangent.astype(jnp.float32), axis, scatter_dimension=dim, tiled=True
    )
    return (summed.astype(shard_dtype),)


_gather.defvjp(_gather_fwd, _gather_bwd)


def exclude_gathered(policy: Callable[..., bool] | None) -> Callable[..., bool]:
    """A ``jax.checkpoint`` policy that saves what ``policy`` saves (None: nothing) except the
    gathered weights, which the backward pass gathers again."""

    def saveable(prim: Any, *args: Any, **params: Any) -> bool:
        if params.get("name") == GATHERED_NAME:
            return False
        if prim is jax.lax.all_gather_p:  # quantised codes, gathered without a custom_vjp
            return False
        return bool(policy(prim, *args, **params)) if policy is not None else False

    return saveable
