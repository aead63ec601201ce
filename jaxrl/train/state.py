"""``TrainState``: everything a step reads and writes, as one pytree."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax


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
