"""The train step ``(state, batch, bounds) -> (state, metrics)``: one jit per bucket.

accumulate (shard_map + while_loop, psum'd sums) → one division by the step's global
denominator → global-norm clip → AdamW on fp32 views of the master weights → written back into
the masters (fp32: exactly; a bf16 master by ``master_rounding``, ``jaxrl.train.precision``).
A non-finite loss or gradient skips the update but still counts the documents (the trainer
counts such steps and stops after too many in a row).

With ``state_shardings`` the state stays in them (parameters and fp32 moments sharded by the
logical rules over fsdp/tensor; the optimizer update runs on the shards) and the gradients are
accumulated in the parameters' sharding. One compiled program per batch bucket.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl.losses.normalize import finalize
from jaxrl.models.sharding import avals
from jaxrl.runtime.background_compile import BackgroundCompiles
from jaxrl.runtime.mesh import batch_sharding, make_mesh, put_batch, replicated
from jaxrl.runtime.spmd import manual_batch_axes
from jaxrl.train.accumulate import LossFn, StepConstants, make_accumulate
from jaxrl.train.per_rank import as_shards
from jaxrl.train.precision import Rounding, write_master
from jaxrl.train.state import TrainState

__all__ = ["BatchSignature", "TrainStep", "batch_signature", "make_mesh"]

# what picks a step program besides the state: each batch field's (name, shape, dtype)
BatchSignature = tuple[tuple[str, tuple[int, ...], str], ...]


def batch_signature(batch: dict[str, Any]) -> BatchSignature:
    """The batch's fields as ``(name, shape, dtype)``, sorted by name (JSON-able as lists)."""
    return tuple(
        (name, tuple(int(n) for n in x.shape), np.dtype(x.dtype).name)
        for name, x in sorted(batch.items())
    )


class TrainStep:
    """A compiled train step plus its compile counter (traces of the step body)."""

    def __init__(
        self,
        loss_fn: LossFn,
        tx: optax.GradientTransformation,
        mesh: Mesh,
        *,
        learning_rate: Callable[[jax.Array], jax.Array],
        max_grad_norm: float = 0.0,
        docs_per_step: int = 0,
        loop: Literal["while", "scan"] = "while",
        donate: bool = True,
        state_shardings: Any | None = None,
        master_rounding: Rounding | None = None,
        frozen: Any = None,
        frozen_shardings: Any = None,
        step_constants: StepConstants | None = None,
    ):
        """``frozen``: the loss's constant inputs (a LoRA run's frozen base, already placed in
        ``frozen_shardings``): ``loss_fn(params, mb, frozen)``; only ``state.params`` are
        differentiated and updated. With ``state_shardings`` (and ``frozen_shardings``) and
        ``fsdp > 1``, both enter the accumulation as ZeRO-3 shards (``accumulate.py``).
        ``step_constants``: a no-grad pre-pass's step-wide fields (``make_accumulate``)."""
        self.mesh = mesh
        self.frozen = frozen
        self.compiles = 0
        self.last_compile = ""  # the shapes the last compile was for (trainers log it)
        self.signatures: list[BatchSignature] = []  # the batches compiled for, in order
        self._precompiled = BackgroundCompiles()  # ``precompile``'s programs
        self.state_shardings = state_shardings
        grad_specs = None if state_shardings is None else _specs(state_shardings.params)
        # ZeRO-3 updates in place (below); other layouts keep the select of new and old values
        self._in_place = as_shards(grad_specs, manual_batch_axes(mesh))
        self._accumulate = make_accumulate(
            loss_fn,
            mesh,
            docs_per_step=docs_per_step,
            loop=loop,
            grad_specs=grad_specs,
            frozen_specs=None if frozen_shardings is None else _specs(frozen_shardings),
            step_constants=step_constants,
        )
        self._tx = tx
        self._lr = learning_rate
        self._max_grad_norm = float(max_grad_norm)
        self._rounding = master_rounding
        out = None if state_shardings is None else (state_shardings, replicated(mesh))
        self._jitted = jax.jit(self._step, donate_argnums=(0,) if donate else (), out_shardings=out)

    def shard_batch(self, batch: dict[str, Any]) -> dict[str, jax.Array]:
        """Put a host batch ``[R, M, ...]`` on the mesh, split over the batch axes (each process
        reads only its own ranks' rows)."""
        return put_batch(batch, self.mesh)

    def place(self, tree: Any) -> Any:
        """Place a state in the step's state shardings (replicated without them), as the step
        returns it. Call once on a fresh or restored state: a state on another placement would
        compile a second program on the next step."""
        target = self.state_shardings
        if target is None:
            target = NamedSharding(self.mesh, PartitionSpec())
        return jax.device_put(tree, target)

    def __call__(
        self,
        state: TrainState,
        batch: dict[str, jax.Array],
        start: int = 0,
        stop: int | None = None,
    ) -> tuple[TrainState, dict[str, jax.Array]]:
        num_slots = next(iter(batch.values())).shape[1]
        bounds = np.asarray([start, num_slots if stop is None else stop], np.int32)
        self._precompiled.wait(batch_signature(batch))  # compiling in the background: wait
        return self._jitted(state, batch, bounds, self.frozen)

    def precompile(self, state: TrainState, signature: BatchSignature) -> None:
        """Compile, on the background thread (``jaxrl.runtime.background_compile``), the
        program a step on ``state`` (placed as the step keeps it) and a sharded batch of
        ``signature`` runs; that step waits for it and neither traces nor compiles. Trainers
        call it with the batches a previous run of the same config compiled for (remembered
        beside the persistent compile cache: ``jaxrl.runtime.compile_cache.remembered``)."""
        signature = tuple(  # as batch_signature gives it (a JSON list: lists)
            (str(name), tuple(int(n) for n in shape), str(dtype))
            for name, shape, dtype in signature
        )
        abstract = avals(state)
        sharding = batch_sharding(self.mesh)
        batch = {
            name: jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype), sharding=sharding)
            for name, shape, dtype in signature
        }
        bounds = jax.ShapeDtypeStruct((2,), jnp.int32)
        frozen = self.frozen

        def compile_step() -> None:
            self._jitted.lower(abstract, batch, bounds, frozen).compile()

        self._precompiled.start(signature, compile_step)

    def _clipped(self, grads: Any, grad_norm: jax.Array) -> Any:
        if self._max_grad_norm <= 0:
            return grads
        scale = jnp.minimum(1.0, self._max_grad_norm / (grad_norm + 1e-6))
        return jax.tree.map(lambda g: g * scale, grads)

    def _update(self, params: Any, opt_state: Any, grads: Any, key: jax.Array):
        """AdamW on fp32 views of the masters, written back into them (``write_master``)."""
        params32 = jax.tree.map(lambda p: p.astype(jnp.float32), params)
        updates, opt_state = self._tx.update(grads, opt_state, params32)
        new32 = jax.tree.map(jnp.add, params32, updates)
        return write_master(params, new32, key, self._rounding), opt_state

    def _update_in_place(self, state: TrainState, sums: Any, loss: jax.Array, key: jax.Array):
        """ZeRO-3's update: under ``lax.cond`` on "the step is finite" (not a select of new and
        old values), with the division and clipping inside it, so the update is written over
        the donated shards instead of beside them and no finished-gradient tree is held."""

        def finalized(sum_grads: Any) -> Any:  # the gradient of the loss: one division
            return jax.tree.map(lambda g: finalize(g, sums.denominator), sum_grads)

        grad_norm = optax.tree.norm(finalized(sums.grads))

        def update(params: Any, opt_state: Any, sum_grads: Any) -> tuple[Any, Any]:
            grads = self._clipped(finalized(sum_grads), grad_norm)
            return self._update(params, opt_state, grads, key)

        finite = jnp.isfinite(grad_norm) & jnp.isfinite(loss)
        new_params, opt_state = jax.lax.cond(
            finite, update, lambda p, o, g: (p, o), state.params, state.opt_state, sums.grads
        )
        return grad_norm, finite, new_params, opt_state

    def _step(self, state: TrainState, batch, bounds, frozen):
        self.compiles += 1  # runs only while tracing, i.e. once per compilation
        self.last_compile = f"rows [R, M, T] = {list(batch['tokens'].shape)}"
        if (signature := batch_signature(batch)) not in self.signatures:
            self.signatures.append(signature)
        sums = self._accumulate(state.params, batch, bounds, frozen)
        loss = finalize(sums.numerator, sums.denominator)
        key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
        if self._in_place:
            grad_norm, finite, new_params, opt_state = self._update_in_place(state, sums, loss, key)
        else:
            grads = jax.tree.map(lambda g: finalize(g, sums.denominator), sums.grads)
            grad_norm = optax.tree.norm(grads)
            grads = self._clipped(grads, grad_norm)
            new_params, opt_state = self._update(state.params, state.opt_state, grads, key)
            finite = jnp.isfinite(grad_norm) & jnp.isfinite(loss)
            keep = functools.partial(jax.tree.map, lambda new, old: jnp.where(finite, new, old))
            new_params = keep(new_params, state.params)
            opt_state = keep(opt_state, state.opt_state)
        new_state = state.replace(
            params=new_params,
            opt_state=opt_state,
            step=state.step + 1,
            documents_seen=state.documents_seen + sums.documents,
        )
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            "learning_rate": self._lr(state.step),
            "num_documents": sums.documents,
            "documents_seen": new_state.documents_seen,
            "num_tokens": sums.tokens,
            "num_loss_tokens": sums.loss_tokens,
            "num_micro_batches": sums.micro_batches,
            "denominator": sums.denominator,
            "update_skipped": jnp.logical_not(finite),
            "cursor": sums.end,
        }
        for name, (total, count) in sums.metrics.items():
            metrics[name] = total / jnp.maximum(count, 1.0)
        return new_state, metrics


def _specs(shardings: Any) -> Any:
    """The PartitionSpecs of a tree of NamedShardings."""
    return jax.tree.map(lambda s: s.spec, shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
