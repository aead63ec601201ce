"""``TrainState``: everything a step reads and writes, as one pytree, created on its shards."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from jaxrl.models.sharding import state_shardings


@flax.struct.dataclass
class TrainState:
    """Parameters (param_dtype), fp32 optimizer state, counters and the RNG key."""

    params: Any
    opt_state: Any
    step: jax.Array  # int32 scalar: optimizer steps taken
    documents_seen: jax.Array  # int32 scalar: documents consumed, including skipped updates
    rng: jax.Array  # uint32[2] raw PRNG key data

    @classmethod
    def create(cls, params: Any, tx: optax.GradientTransformation, seed: int) -> TrainState:
        """Fresh state: optimizer moments are initialised on fp32 copies of the parameters."""
        params32 = jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), params)
        return cls(
            params=params,
            opt_state=tx.init(params32),
            step=jnp.zeros((), jnp.int32),
            documents_seen=jnp.zeros((), jnp.int32),
            rng=jax.random.key_data(jax.random.key(seed)),
        )


def abstract_state(
    params_fn: Callable[[], Any] | Any, tx: optax.GradientTransformation, seed: int, mesh: Mesh
) -> tuple[TrainState, Any]:
    """``(shapes, shardings)`` of the state :func:`create_state` builds: ``ShapeDtypeStruct``s
    (nothing is allocated) and their shardings under the ``jaxrl.models.sharding`` rules."""
    init, args = _initializer(params_fn, tx, seed)
    shapes = jax.eval_shape(init, *args)
    return shapes, state_shardings(shapes, mesh)


def create_state(
    params_fn: Callable[[], Any] | Any, tx: optax.GradientTransformation, seed: int, mesh: Mesh
) -> tuple[TrainState, Any]:
    """``(state, shardings)``: a fresh state built under ``jit`` straight into its shardings
    (``jaxrl.models.sharding`` rules on ``mesh``), never whole on one device.

    ``params_fn``: a function that creates the parameters (e.g. initialises a model: it runs
    under ``jit`` with sharded outputs), or already-placed parameters (e.g. from
    ``from_pretrained(..., mesh=mesh)``), which are not copied to one device either.
    """
    init, args = _initializer(params_fn, tx, seed)
    _, shardings = abstract_state(params_fn, tx, seed, mesh)
    return jax.jit(init, out_shardings=shardings)(*args), shardings


def _initializer(
    params_fn: Callable[[], Any] | Any, tx: optax.GradientTransformation, seed: int
) -> tuple[Callable[..., TrainState], tuple[Any, ...]]:
    """``(init, args)`` with ``init(*args)`` the fresh state."""
    if callable(params_fn):
        return lambda: TrainState.create(params_fn(), tx, seed), ()
    return lambda params: TrainState.create(params, tx, seed), (params_fn,)
