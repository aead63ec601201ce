"""Expert parallelism over the ``expert`` mesh axis: each device computes only its experts.

Inside a ``shard_map`` manual over ``expert`` (the engine's, ``jaxrl.train.accumulate``), the
expert kernels arrive as this device's block of experts and are marked with :data:`EXPERT`
metadata (the mesh axis). Tokens are replicated over the axis (they are split over the batch
axes only), so every device routes all of its rank's tokens, runs the grouped matmul on the
pairs routed to its own experts (``grouped.experts`` with ``expert_shard``) and a ``psum`` over
the axis adds the devices' partial outputs: each pair is computed exactly once, on the device
holding its expert (SkyRL's replicated-token dispatch; an all-to-all dispatch would also split
the token work). The ``psum``'s transpose in the backward pass is again a ``psum``, and each
device's expert gradients are its own experts' only.

Outside such a program (unmarked kernels), :func:`run` is the plain grouped matmul.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

EXPERT = "expert_shard"  # Variable metadata: the mesh axis the experts are split over


def run(
    x_ND: jax.Array,
    routing: Any,
    w: Any,
    experts: Callable[..., jax.Array],
    axis: str | None = None,
) -> jax.Array:
    """``experts(x_ND, routing, w)``; with ``axis`` (a manual mesh axis over which ``w`` holds
    this device's contiguous block of experts) the partial sums psum'd over it."""
    if axis is None:
        return experts(x_ND, routing, w)
    local = w.gate_EDF.shape[0]
    first = jax.lax.axis_index(axis) * local
    return jax.lax.psum(experts(x_ND, routing, w, (first, local)), axis)
