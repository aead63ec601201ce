"""Variable-length gradient accumulation: ``lax.while_loop`` over rounds inside ``shard_map``.

A device batch holds, per data-parallel rank, M micro-batch slots (one packed row each):
arrays ``[R, M, ...]`` with R = data × fsdp ranks, split over the batch axes
(``jaxrl.runtime.mesh``). Round i is slot i on every rank.

The ``shard_map`` is manual over the batch axes (``data``, ``fsdp``) only; ``tensor`` stays
automatic, so XLA partitions the model's matmuls over heads / MLP units / vocabulary. The
parameters enter replicated over the batch axes (the fsdp shards are all-gathered once per
step, at entry); each round's fp32 gradient is reduce-scattered over ``fsdp`` into the
parameter's own sharding (``psum_scatter``, never an all-reduce followed by a slice), so the
accumulator holds 1/fsdp of the gradients; a ``psum`` over ``data`` after the loop finishes
the sum. Axes of size 1 are left out of the manual set (and with none left there is no
``shard_map``).

Starting at the cursor ``start``, the loop consumes rounds while ``i < stop`` and, when
``docs_per_step > 0``, while the psum'd document total is below the target. The round that
crosses the target is kept (Fast-LLM), so every rank runs the same number of rounds.

Per round, the loss function returns the micro-batch's numerator, denominator and metric
(sum, count) pairs; gradients of the numerator accumulate in fp32. Everything is summed over
the ranks once after the loop; the caller divides once. Nothing here divides by the number of
micro-batches, which is what makes the result independent of the layout.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxrl.losses.normalize import LossTerms, num_documents
from jaxrl.runtime.mesh import DATA_AXIS, FSDP_AXIS
from jaxrl.runtime.spmd import manual_batch_axes

LossFn = Callable[[Any, dict[str, jax.Array]], LossTerms]


class StepSums(NamedTuple):
    """Global (psum'd) sums of one optimizer step's consumed rounds."""

    grads: Any  # fp32 gradient of the summed numerator (in the parameters' fsdp sharding)
    numerator: jax.Array
    denominator: jax.Array
    metrics: dict[str, tuple[jax.Array, jax.Array]]
    documents: jax.Array  # int32: the step's document count D (the docs_per_step divisor)
    tokens: jax.Array  # int32: real (non-padding) tokens consumed
    micro_batches: jax.Array  # int32: non-empty micro-batches consumed, over all ranks
    end: jax.Array  # int32: cursor after the last consumed round
    loss_tokens: jax.Array  # int32: consumed tokens with loss_mask > 0 (all real tokens without)


def fsdp_dim(spec: P) -> int | None:
    """The dimension a parameter's PartitionSpec shards over ``fsdp`` (None: not sharded)."""
    for dim, entry in enumerate(spec):
        names = (entry,) if isinstance(entry, str) else tuple(entry or ())
        if FSDP_AXIS in names:
            return dim
    return None


class _Collectives:
    """Sums over the manual batch axes (identity for axes left out of the manual set)."""

    def __init__(self, manual: tuple[str, ...], grad_specs: Any | None):
        self.manual = manual
        self.grad_specs = grad_specs
        self.scatter = FSDP_AXIS in manual and grad_specs is not None

    def psum(self, tree: Any, axes: tuple[str, ...] | None = None) -> Any:
        axes = tuple(a for a in (axes or self.manual) if a in self.manual)
        return jax.lax.psum(tree, axes) if axes else tree

    def grads_over_fsdp(self, grads: Any) -> Any:
        """A round's gradients summed over fsdp: reduce-scattered into each parameter's fsdp
        shard (psum for parameters that are not split over fsdp)."""
        if FSDP_AXIS not in self.manual:
            return grads
        if not self.scatter:
            return jax.lax.psum(grads, FSDP_AXIS)

        def one(g: jax.Array, spec: P) -> jax.Array:
            dim = fsdp_dim(spec)
            if dim is None:
                return jax.lax.psum(g, FSDP_AXIS)
            return jax.lax.psum_scatter(g, FSDP_AXIS, scatter_dimension=dim, tiled=True)

        return jax.tree.map(one, grads, self.grad_specs, is_leaf=lambda x: isinstance(x, P))


def _zeros_like_terms(loss_fn: LossFn, params: Any, mb: dict[str, jax.Array]) -> LossTerms:
    shapes = jax.eval_shape(loss_fn, params, mb)
    return jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), shapes)


def _rank_sums(
    loss_fn: LossFn,
    params: Any,
    batch_MT: dict[str, jax.Array],
    bounds: jax.Array,
    *,
    docs_per_step: int,
    loop: Literal["while", "scan"],
    comm: _Collectives,
    frozen: Any = None,
) -> StepSums:
    """One rank's accumulation (inside shard_map); returns sums over every rank. ``frozen``:
    constant inputs of the loss (a LoRA run's base), passed as ``loss_fn(params, mb, frozen)``
    and not differentiated."""
    if frozen is not None:
        loss_fn = functools.partial(_with_frozen, loss_fn, frozen=frozen)
    docs_M = num_documents(batch_MT["segment_ids"]).astype(jnp.int32)
    global_docs_M = comm.psum(docs_M)
    real_MT = batch_MT["segment_ids"] > 0
    tokens_M = jnp.sum(real_MT, axis=-1).astype(jnp.int32)
    if "loss_mask" in batch_MT:
        real_MT = real_MT & (batch_MT["loss_mask"] > 0)
    loss_tokens_M = jnp.sum(real_MT, axis=-1).astype(jnp.int32)
    num_slots = docs_M.shape[0]
    start, stop = bounds[0], jnp.minimum(bounds[1], num_slots)

    def micro_batch(i):
        return jax.tree.map(
            lambda x: jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=True), batch_MT
        )

    grad_fn = jax.value_and_grad(lambda p, mb: _numerator(loss_fn, p, mb), has_aux=True)
    zero_terms = _zeros_like_terms(loss_fn, params, micro_batch(0))
    shard_shapes = jax.eval_shape(comm.grads_over_fsdp, params)
    zero_grads = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), shard_shapes)

    def add(carry, i, active):
        grads, terms, total, mbs, toks, loss_toks = carry
        (_, t), g = grad_fn(params, micro_batch(i))
        w = active.astype(jnp.float32)
        g = comm.grads_over_fsdp(jax.tree.map(lambda b: w * b.astype(jnp.float32), g))
        grads = jax.tree.map(jnp.add, grads, g)
        terms = jax.tree.map(lambda a, b: a + w * b.astype(jnp.float32), terms, t)
        total = total + jnp.where(active, global_docs_M[i], 0)
        mbs = mbs + jnp.where(active & (docs_M[i] > 0), 1, 0)
        toks = toks + jnp.where(active, tokens_M[i], 0)
        loss_toks = loss_toks + jnp.where(active, loss_tokens_M[i], 0)
        return grads, terms, total, mbs, toks, loss_toks

    init = (zero_grads, zero_terms, jnp.int32(0), jnp.int32(0), jnp.int32(0), jnp.int32(0))
    if loop == "while":

        def cond(state):
            i, (_, _, total, _, _, _) = state
            below = (docs_per_step == 0) | (total < docs_per_step)
            return (i < stop) & below

        def body(state):
            i, carry = state
            return i + 1, add(carry, i, jnp.bool_(True))

        end, carry = jax.lax.while_loop(cond, body, (start, init))
    else:  # static baseline for benchmarks: every slot in [start, stop), no early exit

        def scan_body(carry, i):
            return add(carry, i, (i >= start) & (i < stop)), None

        carry, _ = jax.lax.scan(scan_body, init, jnp.arange(num_slots))
        end = stop
    grads, terms, total, mbs, toks, loss_toks = carry
    grads = comm.psum(grads, (DATA_AXIS,))  # already summed over fsdp, round by round
    terms, mbs, toks, loss_toks = comm.psum((terms, mbs, toks, loss_toks))
    return StepSums(
        grads, terms.numerator, terms.denominator, terms.metrics, total, toks, mbs, end, loss_toks
    )


def _with_frozen(
    loss_fn: Callable[..., LossTerms], params: Any, mb: dict[str, jax.Array], *, frozen: Any
) -> LossTerms:
    return loss_fn(params, mb, frozen)


def _numerator(loss_fn: LossFn, params: Any, mb: dict[str, jax.Array]):
    terms = loss_fn(params, mb)
    return terms.numerator, terms


def make_accumulate(
    loss_fn: LossFn,
    mesh: Mesh,
    *,
    docs_per_step: int = 0,
    loop: Literal["while", "scan"] = "while",
    grad_specs: Any | None = None,
) -> Callable[..., StepSums]:
    """``(params, batch[R,M,...], bounds[2], frozen=None) -> StepSums``, manual over the batch
    axes. ``frozen`` (e.g. a LoRA run's base) enters the loss as ``loss_fn(params, mb, frozen)``
    replicated over the batch axes as the parameters do, and gets no gradient.

    ``bounds = [start, stop]`` selects the slots this step may consume (data, not static), so
    one compiled program serves every step of a bucket and a cursor can carry over between
    steps that share one device buffer. ``grad_specs``: the parameters' PartitionSpecs
    (``state_partition_specs(params, mesh=mesh)``); gradients come back split over fsdp as the
    parameters are (without it they come back whole).
    """
    manual = manual_batch_axes(mesh)
    comm = _Collectives(manual, grad_specs)

    def per_rank(params, batch, bounds, frozen=None):
        local = jax.tree.map(lambda x: x[0], batch)  # [1, M, ...] → [M, ...]
        return _rank_sums(
            loss_fn,
            params,
            local,
            bounds,
            docs_per_step=docs_per_step,
            loop=loop,
            comm=comm,
            frozen=frozen,
        )

    if not manual:  # one rank over several tensor devices: XLA partitions the whole loop
        return per_rank
    grads_spec = P()
    if comm.scatter:
        grads_spec = jax.tree.map(
            lambda s: P(*(FSDP_AXIS if d == fsdp_dim(s) else None for d in range(len(s)))),
            grad_specs,
            is_leaf=lambda x: isinstance(x, P),
        )
    out_specs = StepSums(grads_spec, P(), P(), P(), P(), P(), P(), P(), P())
    mapped = jax.shard_map(
        per_rank,
        mesh=mesh,
        in_specs=(P(), P(manual), P(), P()),
        out_specs=out_specs,
        axis_names=set(manual),
        check_vma=False,
    )
    return lambda params, batch, bounds, frozen=None: mapped(params, batch, bounds, frozen)
