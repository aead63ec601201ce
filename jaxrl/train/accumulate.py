"""Variable-length gradient accumulation: ``lax.while_loop`` over rounds inside ``shard_map``.

A device batch holds, per data-parallel rank, K micro-batch slots (one packed row each):
arrays ``[R, K, ...]`` sharded over the ``data`` mesh axis. Round i is slot i on every rank.
Starting at the cursor ``start``, the loop consumes rounds while ``i < stop`` and, when
``docs_per_step > 0``, while the psum'd document total is below the target. The round that
crosses the target is kept (Fast-LLM), so every rank runs the same number of rounds.

Per round, the loss function returns the micro-batch's numerator, denominator and metric
(sum, count) pairs; gradients of the numerator accumulate in fp32. Everything is psum'd over
``data`` once after the loop; the caller divides once. Nothing here divides by the number of
micro-batches, which is what makes the result independent of the layout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxrl.losses.normalize import LossTerms, num_documents

DATA_AXIS = "data"
LossFn = Callable[[Any, dict[str, jax.Array]], LossTerms]


class StepSums(NamedTuple):
    """Global (psum'd) sums of one optimizer step's consumed rounds."""

    grads: Any  # fp32 gradient of the summed numerator
    numerator: jax.Array
    denominator: jax.Array
    metrics: dict[str, tuple[jax.Array, jax.Array]]
    documents: jax.Array  # int32: the step's document count D (the docs_per_step divisor)
    tokens: jax.Array  # int32: real (non-padding) tokens consumed
    micro_batches: jax.Array  # int32: non-empty micro-batches consumed, over all ranks
    end: jax.Array  # int32: cursor after the last consumed round


def _zeros_like_terms(loss_fn: LossFn, params: Any, mb: dict[str, jax.Array]) -> LossTerms:
    shapes = jax.eval_shape(loss_fn, params, mb)
    return jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), shapes)


def _rank_sums(
    loss_fn: LossFn,
    params: Any,
    batch_KT: dict[str, jax.Array],
    bounds: jax.Array,
    *,
    docs_per_step: int,
    loop: Literal["while", "scan"],
) -> StepSums:
    """One rank's accumulation (inside shard_map); returns psum'd sums."""
    docs_K = num_documents(batch_KT["segment_ids"]).astype(jnp.int32)
    global_docs_K = jax.lax.psum(docs_K, DATA_AXIS)
    tokens_K = jnp.sum(batch_KT["segment_ids"] > 0, axis=-1).astype(jnp.int32)
    num_slots = docs_K.shape[0]
    start, stop = bounds[0], jnp.minimum(bounds[1], num_slots)

    def micro_batch(i):
        return jax.tree.map(
            lambda x: jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=True), batch_KT
        )

    grad_fn = jax.value_and_grad(lambda p, mb: _numerator(loss_fn, p, mb), has_aux=True)
    zero_terms = _zeros_like_terms(loss_fn, params, micro_batch(0))
    zero_grads = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)

    def add(carry, i, active):
        grads, terms, total, mbs, toks = carry
        (_, t), g = grad_fn(params, micro_batch(i))
        w = active.astype(jnp.float32)
        grads = jax.tree.map(lambda a, b: a + w * b.astype(jnp.float32), grads, g)
        terms = jax.tree.map(lambda a, b: a + w * b.astype(jnp.float32), terms, t)
        total = total + jnp.where(active, global_docs_K[i], 0)
        mbs = mbs + jnp.where(active & (docs_K[i] > 0), 1, 0)
        toks = toks + jnp.where(active, tokens_K[i], 0)
        return grads, terms, total, mbs, toks

    init = (zero_grads, zero_terms, jnp.int32(0), jnp.int32(0), jnp.int32(0))
    if loop == "while":

        def cond(state):
            i, (_, _, total, _, _) = state
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
    grads, terms, total, mbs, toks = carry
    grads, terms, mbs, toks = jax.lax.psum((grads, terms, mbs, toks), DATA_AXIS)
    return StepSums(grads, terms.numerator, terms.denominator, terms.metrics, total, toks, mbs, end)


def _numerator(loss_fn: LossFn, params: Any, mb: dict[str, jax.Array]):
    terms = loss_fn(params, mb)
    return terms.numerator, terms


def make_accumulate(
    loss_fn: LossFn,
    mesh: Mesh,
    *,
    docs_per_step: int = 0,
    loop: Literal["while", "scan"] = "while",
) -> Callable[[Any, dict[str, jax.Array], jax.Array], StepSums]:
    """``(params, batch[R,K,...], bounds[2]) -> StepSums`` sharded over the data axis.

    ``bounds = [start, stop]`` selects the slots this step may consume (data, not static), so
    one compiled program serves every step of a bucket and a cursor can carry over between
    steps that share one device buffer.
    """

    def per_rank(params, batch, bounds):
        local = jax.tree.map(lambda x: x[0], batch)  # [1, K, ...] → [K, ...]
        return _rank_sums(loss_fn, params, local, bounds, docs_per_step=docs_per_step, loop=loop)

    return jax.shard_map(
        per_rank,
        mesh=mesh,
        in_specs=(P(), P(DATA_AXIS), P()),
        out_specs=P(),
        check_vma=False,
    )
