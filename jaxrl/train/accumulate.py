"""Variable-length gradient accumulation: ``lax.while_loop`` over rounds inside ``shard_map``.

A device batch holds, per data-parallel rank, M micro-batch slots (one packed row each):
arrays ``[R, M, ...]`` with R = data × fsdp ranks, split over the batch axes
(``jaxrl.runtime.mesh``). Round i is slot i on every rank.

The ``shard_map`` is manual over the batch axes (``data``, ``fsdp``) only; ``tensor`` stays
automatic, so XLA partitions the model's matmuls over heads / MLP units / vocabulary (the
scorer's program has the same shape: ``jaxrl.train.per_rank``).

ZeRO-3 (``fsdp > 1`` with ``grad_specs``): the parameters enter as their fsdp shards
(``in_specs`` from their own PartitionSpecs, restricted to the manual axes) and stay sharded
for the whole step. The loss sees them marked for gathering (``jaxrl.models.fsdp``): the model
all-gathers each weight at its point of use, in the dtype it computes with — one scanned layer
at a time inside the layer ``scan``, the embedding and LM head where they are used — and the
gather's transpose reduce-scatters that weight's fp32 gradient over ``fsdp`` as the backward
pass produces it. So no device ever holds the whole model or a whole gradient; the accumulator
holds 1/fsdp of the gradients. Parameters not split over fsdp (a dimension it does not divide)
enter whole and their round gradients are ``psum``'d over ``fsdp``. A ``psum`` over ``data``
after the loop finishes the sum. Axes of size 1 are left out of the manual set (and with none
left there is no ``shard_map``).

Starting at the cursor ``start``, the loop (state :class:`Rounds`, its sums
:class:`RoundSums`) consumes rounds while ``i < stop`` and, when
``docs_per_step > 0``, while the psum'd document total is below the target. The round that
crosses the target is kept (Fast-LLM), so every rank runs the same number of rounds.

Per round, the loss function returns the micro-batch's numerator, denominator and metric
(sum, count) pairs; gradients of the numerator accumulate in fp32. Everything is summed over
the ranks once after the loop; the caller divides once. Nothing here divides by the number of
micro-batches, which is what makes the result independent of the layout.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxrl.losses.normalize import LossTerms, num_documents
from jaxrl.runtime.mesh import DATA_AXIS, FSDP_AXIS
from jaxrl.runtime.spmd import manual_batch_axes
from jaxrl.train.per_rank import as_shards, fsdp_dim, in_specs_of, is_spec, marked, per_rank_map

LossFn = Callable[[Any, dict[str, jax.Array]], LossTerms]
# the step's summed LossTerms of a no-grad pre-pass -> fields added to every micro-batch
StepConstants = Callable[[LossTerms], dict[str, jax.Array]]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepSums:
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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RoundSums:
    """One rank's running sums over the rounds it consumed (the accumulation loop's carry)."""

    grads: Any  # fp32, summed over fsdp round by round (a ZeRO-3 shard's: its own)
    terms: LossTerms  # fp32 sums of the rounds' LossTerms
    documents: jax.Array  # int32: the rounds' documents over every rank (the docs_per_step stop)
    micro_batches: jax.Array  # int32: this rank's non-empty micro-batches
    tokens: jax.Array  # int32: this rank's real tokens
    loss_tokens: jax.Array  # int32: this rank's tokens with loss_mask > 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrePassSums:
    """The ``step_constants`` pre-pass's running sums (its loop's carry)."""

    terms: LossTerms  # fp32 sums of the rounds' LossTerms (no gradient)
    documents: jax.Array  # int32: the rounds' documents over every rank (the docs_per_step stop)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Rounds:
    """The rounds loop's state: the cursor and the running sums (``RoundSums`` or
    ``PrePassSums``); after the loop, the cursor is the first round not consumed."""

    cursor: jax.Array  # int32: the next round (micro-batch slot) to consume
    sums: Any


class _Collectives:
    """Sums over the manual batch axes (identity for axes left out of the manual set)."""

    def __init__(self, manual: tuple[str, ...], grad_specs: Any | None):
        self.manual = manual
        self.grad_specs = grad_specs
        self.scatter = as_shards(grad_specs, manual)

    def psum(self, tree: Any, axes: tuple[str, ...] | None = None) -> Any:
        axes = tuple(a for a in (axes or self.manual) if a in self.manual)
        return jax.lax.psum(tree, axes) if axes else tree

    def grads_over_fsdp(self, grads: Any) -> Any:
        """A round's gradients summed over fsdp. A ZeRO-3 shard's gradient already is: the
        gather's transpose reduce-scattered it (``jaxrl.models.fsdp``); parameters that enter
        whole are ``psum``'d."""
        if FSDP_AXIS not in self.manual:
            return grads
        if not self.scatter:
            return jax.lax.psum(grads, FSDP_AXIS)

        def one(g: jax.Array, spec: P) -> jax.Array:
            return jax.lax.psum(g, FSDP_AXIS) if fsdp_dim(spec) is None else g

        return jax.tree.map(one, grads, self.grad_specs, is_leaf=is_spec)


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
    frozen_specs: Any = None,
    step_constants: StepConstants | None = None,
) -> StepSums:
    """One rank's accumulation (inside shard_map); returns sums over every rank. ``frozen``:
    constant inputs of the loss (a LoRA run's base), passed as ``loss_fn(params, mb, frozen)``
    and not differentiated. ZeRO-3 shards (of ``params``, and of ``frozen`` by ``frozen_specs``)
    reach the loss marked for gathering; the gradients are taken of the unmarked shards."""
    if frozen is not None:
        frozen = marked(frozen, frozen_specs, comm.manual)
        loss_fn = functools.partial(_with_frozen, loss_fn, frozen=frozen)
    if comm.scatter:
        loss_fn = functools.partial(_on_marked, loss_fn, comm=comm)
    # each use below traces the loss once for the zeros of its terms and the loop that sums
    # them (jit caches the trace); inline=True copies its equations in as a direct call would
    loss_fn = jax.jit(loss_fn, inline=True)
    docs_M = num_documents(batch_MT["segment_ids"], batch_MT.get("parent_ids")).astype(jnp.int32)
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

    def rounds(add, init, total_of) -> Rounds:
        """``add(sums, i, active)`` over the step's rounds per ``loop``, from ``init``;
        ``total_of(sums)``: the documents consumed so far (the ``docs_per_step`` stop)."""
        if loop == "while":

            def cond(state: Rounds) -> jax.Array:
                below = (docs_per_step == 0) | (total_of(state.sums) < docs_per_step)
                return (state.cursor < stop) & below

            def body(state: Rounds) -> Rounds:
                sums = add(state.sums, state.cursor, jnp.bool_(True))
                return Rounds(cursor=state.cursor + 1, sums=sums)

            return jax.lax.while_loop(cond, body, Rounds(cursor=start, sums=init))

        # static baseline for benchmarks: every slot in [start, stop), no early exit
        def scan_body(sums, i):
            return add(sums, i, (i >= start) & (i < stop)), None

        sums, _ = jax.lax.scan(scan_body, init, jnp.arange(num_slots))
        return Rounds(cursor=stop, sums=sums)

    if step_constants is not None:  # a no-grad pre-pass over the same rounds (docs/moe.md)
        micro_batch = _with_step_constants(
            loss_fn, params, micro_batch, rounds, global_docs_M, step_constants, comm
        )

    grad_fn = jax.value_and_grad(lambda p, mb: _numerator(loss_fn, p, mb), has_aux=True)
    zero_terms = _zeros_like_terms(loss_fn, params, micro_batch(0))
    shard_shapes = jax.eval_shape(comm.grads_over_fsdp, params)
    zero_grads = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), shard_shapes)

    def add(sums: RoundSums, i: jax.Array, active: jax.Array) -> RoundSums:
        (_, t), g = grad_fn(params, micro_batch(i))
        w = active.astype(jnp.float32)
        g = comm.grads_over_fsdp(jax.tree.map(lambda b: w * b.astype(jnp.float32), g))
        return RoundSums(
            grads=jax.tree.map(jnp.add, sums.grads, g),
            terms=jax.tree.map(lambda a, b: a + w * b.astype(jnp.float32), sums.terms, t),
            documents=sums.documents + jnp.where(active, global_docs_M[i], 0),
            micro_batches=sums.micro_batches + jnp.where(active & (docs_M[i] > 0), 1, 0),
            tokens=sums.tokens + jnp.where(active, tokens_M[i], 0),
            loss_tokens=sums.loss_tokens + jnp.where(active, loss_tokens_M[i], 0),
        )

    zero = jnp.int32(0)
    init = RoundSums(
        grads=zero_grads,
        terms=zero_terms,
        documents=zero,
        micro_batches=zero,
        tokens=zero,
        loss_tokens=zero,
    )
    done = rounds(add, init, lambda sums: sums.documents)
    sums = done.sums
    grads = comm.psum(sums.grads, (DATA_AXIS,))  # already summed over fsdp, round by round
    # the rank's own counts and terms over every rank (documents already are)
    totals = comm.psum(dataclasses.replace(sums, grads=None, documents=None))
    return StepSums(
        grads=grads,
        numerator=totals.terms.numerator,
        denominator=totals.terms.denominator,
        metrics=totals.terms.metrics,
        documents=sums.documents,
        tokens=totals.tokens,
        micro_batches=totals.micro_batches,
        end=done.cursor,
        loss_tokens=totals.loss_tokens,
    )


def _with_step_constants(
    loss_fn: LossFn,
    params: Any,
    micro_batch: Callable[[jax.Array], dict[str, jax.Array]],
    rounds: Callable[..., Any],
    global_docs_M: jax.Array,
    step_constants: StepConstants,
    comm: _Collectives,
) -> Callable[[jax.Array], dict[str, jax.Array]]:
    """The gradient pass's micro-batches: ``micro_batch(i)`` plus the fields
    ``step_constants`` makes of the step's ``LossTerms`` summed (over the rounds the step
    consumes, and over the ranks) by a no-grad pre-pass of ``loss_fn``."""
    zero = _zeros_like_terms(loss_fn, params, micro_batch(0))

    def add(sums: PrePassSums, i: jax.Array, active: jax.Array) -> PrePassSums:
        t = loss_fn(params, micro_batch(i))
        w = active.astype(jnp.float32)
        return PrePassSums(
            terms=jax.tree.map(lambda a, b: a + w * b.astype(jnp.float32), sums.terms, t),
            documents=sums.documents + jnp.where(active, global_docs_M[i], 0),
        )

    init = PrePassSums(terms=zero, documents=jnp.int32(0))
    sums = rounds(add, init, lambda sums: sums.documents).sums.terms
    constants = step_constants(comm.psum(jax.lax.stop_gradient(sums)))
    return lambda i: {**micro_batch(i), **constants}


def _with_frozen(
    loss_fn: Callable[..., LossTerms], params: Any, mb: dict[str, jax.Array], *, frozen: Any
) -> LossTerms:
    return loss_fn(params, mb, frozen)


def _on_marked(
    loss_fn: LossFn, params: Any, mb: dict[str, jax.Array], *, comm: _Collectives
) -> LossTerms:
    return loss_fn(marked(params, comm.grad_specs, comm.manual), mb)


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
    frozen_specs: Any | None = None,
    step_constants: StepConstants | None = None,
) -> Callable[..., StepSums]:
    """``(params, batch[R,M,...], bounds[2], frozen=None) -> StepSums``, manual over the batch
    axes. ``frozen`` (e.g. a LoRA run's base) enters the loss as ``loss_fn(params, mb, frozen)``
    replicated over the batch axes as the parameters do, and gets no gradient.

    ``bounds = [start, stop]`` selects the slots this step may consume (data, not static), so
    one compiled program serves every step of a bucket and a cursor can carry over between
    steps that share one device buffer. ``grad_specs``: the parameters' PartitionSpecs
    (``state_partition_specs(params, mesh=mesh)``); with ``fsdp > 1`` the parameters then enter
    as their fsdp shards (ZeRO-3, above) and the gradients come back split over fsdp as the
    parameters are (without it the parameters enter whole and the gradients come back whole).
    ``frozen_specs``: the same for ``frozen`` (without them it enters whole).
    ``step_constants``: a no-grad pre-pass of ``loss_fn`` over the rounds the step consumes
    first sums its ``LossTerms`` (over rounds and ranks); the fields this function makes of
    them join every micro-batch of the gradient pass (the MoE load-balance loss's step-wide
    expert fractions, ``jaxrl.losses.load_balance``).
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
            frozen_specs=frozen_specs,
            step_constants=step_constants,
        )

    # one rank over several tensor devices (no manual axis): XLA partitions the whole loop
    params_spec = in_specs_of(grad_specs, manual)
    whole = P()
    mapped = per_rank_map(
        per_rank,
        mesh,
        in_specs=(params_spec, P(manual), whole, in_specs_of(frozen_specs, manual)),
        out_specs=StepSums(
            grads=params_spec,
            numerator=whole,
            denominator=whole,
            metrics=whole,
            documents=whole,
            tokens=whole,
            micro_batches=whole,
            end=whole,
            loss_tokens=whole,
        ),
    )
    return lambda params, batch, bounds, frozen=None: mapped(params, batch, bounds, frozen)
