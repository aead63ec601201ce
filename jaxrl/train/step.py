"""The train step ``(state, batch, bounds) -> (state, metrics)``: one jit per bucket.

accumulate (shard_map + while_loop, psum'd sums) → one division by the step's global
denominator → global-norm clip → AdamW on fp32 views of the parameters → cast back to each
parameter's dtype. A non-finite gradient skips the update but still counts the documents.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl.losses.normalize import finalize
from jaxrl.train.accumulate import DATA_AXIS, LossFn, make_accumulate
from jaxrl.train.state import TrainState


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
    ):
        self.mesh = mesh
        self.compiles = 0
        self._accumulate = make_accumulate(loss_fn, mesh, docs_per_step=docs_per_step, loop=loop)
        self._tx = tx
        self._lr = learning_rate
        self._max_grad_norm = float(max_grad_norm)
        self._jitted = jax.jit(self._step, donate_argnums=(0,) if donate else ())

    def shard_batch(self, batch: dict[str, Any]) -> dict[str, jax.Array]:
        """Put a host batch ``[R, K, ...]`` on the mesh, split over the data axis."""
        sharding = NamedSharding(self.mesh, P(DATA_AXIS))
        return {k: jax.device_put(v, sharding) for k, v in batch.items()}

    def replicate(self, tree: Any) -> Any:
        """Place a state (or any pytree) replicated on the mesh, as the step returns it.

        Call once on a fresh or restored state: a state on another placement would compile a
        second program on the next step.
        """
        return jax.device_put(tree, NamedSharding(self.mesh, P()))

    def __call__(
        self,
        state: TrainState,
        batch: dict[str, jax.Array],
        start: int = 0,
        stop: int | None = None,
    ) -> tuple[TrainState, dict[str, jax.Array]]:
        num_slots = next(iter(batch.values())).shape[1]
        bounds = jnp.asarray([start, num_slots if stop is None else stop], jnp.int32)
        return self._jitted(state, batch, bounds)

    def _step(self, state: TrainState, batch, bounds):
        self.compiles += 1  # runs only while tracing, i.e. once per compilation
        sums = self._accumulate(state.params, batch, bounds)
        grads = jax.tree.map(lambda g: finalize(g, sums.denominator), sums.grads)
        loss = finalize(sums.numerator, sums.denominator)
        grad_norm = optax.tree.norm(grads)
        if self._max_grad_norm > 0:
            scale = jnp.minimum(1.0, self._max_grad_norm / (grad_norm + 1e-6))
            grads = jax.tree.map(lambda g: g * scale, grads)
        params32 = jax.tree.map(lambda p: p.astype(jnp.float32), state.params)
        updates, opt_state = self._tx.update(grads, state.opt_state, params32)
        new_params = jax.tree.map(
            lambda p, p32, u: (p32 + u).astype(p.dtype), state.params, params32, updates
        )
        finite = jnp.isfinite(grad_norm)
        keep = functools.partial(jax.tree.map, lambda new, old: jnp.where(finite, new, old))
        new_state = state.replace(
            params=keep(new_params, state.params),
            opt_state=keep(opt_state, state.opt_state),
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
            "num_micro_batches": sums.micro_batches,
            "denominator": sums.denominator,
            "update_skipped": jnp.logical_not(finite),
            "cursor": sums.end,
        }
        for name, (total, count) in sums.metrics.items():
            metrics[name] = total / jnp.maximum(count, 1.0)
        return new_state, metrics


def make_mesh(data: int) -> Mesh:
    """A 1-D ``data`` mesh over the first ``data`` devices, with a clear error if too few."""
    devices = jax.devices()
    if data > len(devices):
        raise ValueError(
            f"mesh.data={data} but only {len(devices)} devices are visible; lower mesh.data, or "
            "on CPU set XLA_FLAGS=--xla_force_host_platform_device_count=N before launch"
        )
    return Mesh(devices[:data], (DATA_AXIS,))
