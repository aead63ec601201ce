"""Expert parallelism over the ``expert`` mesh axis: each device computes only its experts.

When the traced program's mesh has an ``expert`` axis (the engine's and the scorer's
``shard_map``, manual over the batch axes, keep it automatic), the MoE block enters a nested
``shard_map`` manual over ``expert`` alone, where the expert kernels (and per-expert LoRA
factors) are this device's block of experts. Tokens are replicated over the axis (they are
split over the batch axes only), so every device routes all of its rank's tokens, runs the
grouped matmul on the pairs routed to its own experts (``grouped.experts`` with
``expert_shard``), and a sum over the axis adds the devices' partial outputs: each pair
is computed once, on the device holding its expert (SkyRL's replicated-token dispatch; an
all-to-all dispatch would also split the token work). ``shard_map``'s autodiff gives each
device its own experts' gradients and sums the replicated inputs' cotangents over the axis.

Elsewhere (no mesh, or a mesh without the axis: the sampler's decode mesh) :func:`run` is the
plain grouped matmul, XLA partitioning it as the weights are placed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

EXPERT_AXIS = "expert"  # the mesh axis (jaxrl.runtime.mesh.EXPERT_AXIS; models sit below runtime)


def expert_axis(num_experts: int) -> int:
    """The size of the ``expert`` axis of the mesh being traced in (its abstract mesh), when
    it is > 1 and not already manual; 0 otherwise (no expert parallelism here). ValueError
    when it does not divide ``num_experts``."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or EXPERT_AXIS not in mesh.axis_names or EXPERT_AXIS in mesh.manual_axes:
        return 0
    size = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))[EXPERT_AXIS]
    if size > 1 and num_experts % size:
        raise ValueError(
            f"mesh.expert={size} does not divide num_experts={num_experts}: use a divisor"
        )
    return size if size > 1 else 0


def run(
    x_ND: jax.Array,
    routing: Any,
    w: Any,
    experts: Callable[..., jax.Array],
) -> jax.Array:
    """``experts(x_ND, routing, w)``, each device of the ``expert`` axis (when the traced
    mesh has one, :func:`expert_axis`) computing its own experts' pairs, the partial outputs
    ``psum``'d over the axis (inside a ``shard_map`` manual over it alone; the other axes
    stay as they are)."""
    if not expert_axis(w.gate_EDF.shape[0]):
        return experts(x_ND, routing, w)

    dtype = x_ND.dtype

    def local(x_ND, routing, w):
        count = w.gate_EDF.shape[0]
        first = jax.lax.axis_index(EXPERT_AXIS) * count
        return experts(x_ND.astype(dtype), routing, w, (first, count))[None]

    def spec(leaf: Any) -> P:  # every expert array is [E, ...]; scaling is a float
        return P(EXPERT_AXIS) if hasattr(leaf, "ndim") and leaf.ndim == 3 else P()

    # each device's partial output on a leading expert axis, summed outside (an all-reduce):
    # the transpose hands every device the cotangent of the sum, and sums the replicated
    # inputs' cotangents (each device's is its own experts' part) over the axis
    partial_XND = jax.shard_map(
        local,
        mesh=jax.sharding.get_abstract_mesh(),
        in_specs=(P(), jax.tree.map(lambda _: P(), routing), jax.tree.map(spec, w)),
        out_specs=P(EXPERT_AXIS),
        axis_names={EXPERT_AXIS},
        check_vma=False,
    )(x_ND.astype(jnp.float32), routing, w)  # its cotangent is summed over the axis in fp32
    return jnp.sum(partial_XND, axis=0).astype(x_ND.dtype)  # summed in float32
