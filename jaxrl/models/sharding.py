"""Logical axis names to mesh axes: one rule table for the whole package.

Parameters carry logical names in their ``out_sharding`` metadata (``transformer.py``);
arrays in batches use ``batch``. The default table shards the model dimension (``embed``) over
``fsdp`` and heads, KV heads and MLP units over ``tensor``; the embedding and the LM head are
split over their vocabulary (``vocab``: fsdp-major over ``fsdp × tensor``), never over their model
dimension (``vocab_embed``), so a ZeRO-3 step never gathers them (``fsdp.py``); batches are split
over ``data × fsdp``. The leading ``layers`` axis of a scanned layer stack
(``layer_stack.py``) is never sharded: each device holds its block of every layer, and the
scan slices layer i locally. fp32 optimizer moments inherit their parameter's names (optax
maps over the same Variables), so they are sharded the same way.

A dimension that the mesh axis size does not divide stays whole on that axis (e.g. 2 KV heads
on ``tensor=4``): sharding it would need padding, and such parameters are small.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

LogicalRules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

LOGICAL_AXIS_RULES: LogicalRules = (
    ("batch", ("data", "fsdp")),
    ("vocab", ("fsdp", "tensor")),  # embedding rows and LM head columns (vocabulary-parallel)
    ("vocab_embed", None),  # the model dimension of the embedding and the LM head
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("layers", None),  # the stacked layer axis of model.scan_layers: every device holds all Nl
    ("expert", "expert"),  # a MoE block's experts (models/moe/): expert parallelism
    ("moe_mlp", "tensor"),  # an expert's FFN units
    ("router_experts", None),  # the router's output (one logit per expert, read whole)
)


def logical_to_spec(
    logical_axes: Sequence[str | None],
    rules: LogicalRules = LOGICAL_AXIS_RULES,
    *,
    shape: Sequence[int] | None = None,
    mesh: Mesh | None = None,
) -> PartitionSpec:
    """PartitionSpec for an array whose axes have these logical names (None = unsharded).

    With ``mesh`` (and ``shape``), mesh axes the mesh lacks or of size 1 are dropped, and a
    dimension the mesh axes do not divide stays unsharded.
    """
    table = dict(rules)
    unknown = [name for name in logical_axes if name is not None and name not in table]
    if unknown:
        raise ValueError(
            f"logical axes {unknown} have no rule; add them to the rules {sorted(table)}"
        )
    entries = []
    for i, name in enumerate(logical_axes):
        target = None if name is None else table[name]
        if target is not None and mesh is not None:
            axes = (target,) if isinstance(target, str) else tuple(target)
            axes = tuple(a for a in axes if mesh.shape.get(a, 1) > 1)
            size = math.prod(mesh.shape[a] for a in axes)
            if not axes or (shape is not None and shape[i] % size):
                target = None
            else:
                target = axes[0] if len(axes) == 1 else axes
        entries.append(target)
    return PartitionSpec(*entries)


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def _variable_spec(
    variable: nnx.Variable, rules: LogicalRules, mesh: Mesh | None = None
) -> PartitionSpec:
    axes = variable.get_metadata().get("out_sharding")
    if not axes:
        return PartitionSpec()
    if len(axes) != len(variable.shape):
        raise ValueError(
            f"out_sharding {axes} names {len(axes)} axes for a value of shape {variable.shape}"
        )
    return logical_to_spec(axes, rules, shape=variable.shape, mesh=mesh)


def state_partition_specs(
    state: Any, rules: LogicalRules = LOGICAL_AXIS_RULES, *, mesh: Mesh | None = None
) -> Any:
    """The tree with every Variable's value replaced by its PartitionSpec (other leaves: ``P()``).

    Works on concrete or abstract (``nnx.eval_shape`` / ``jax.eval_shape``) trees: parameters,
    optimizer states (whose moments keep their parameter's Variable metadata) or a whole
    ``TrainState``. Variables without logical metadata, and plain leaves, are replicated.
    """
    return jax.tree.map(
        lambda v: v.replace(_variable_spec(v, rules, mesh)) if _is_variable(v) else PartitionSpec(),
        state,
        is_leaf=_is_variable,
    )


def state_shardings(state: Any, mesh: Mesh, rules: LogicalRules = LOGICAL_AXIS_RULES) -> Any:
    """NamedShardings for ``state`` under ``mesh``: pass to ``jax.device_put`` or ``jax.jit``."""
    return jax.tree.map(
        lambda spec: NamedSharding(mesh, spec),
        state_partition_specs(state, rules, mesh=mesh),
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )


def avals(tree: Any, shardings: Any = None) -> Any:
    """``jax.ShapeDtypeStruct``s of ``tree``'s leaves (arrays or ShapeDtypeStructs) carrying
    ``shardings`` (a matching tree), or without it each leaf's own: what ``jit(...).lower``
    takes to compile for arrays that do not exist yet."""
    aval = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)  # noqa: E731
    if shardings is None:
        return jax.tree.map(lambda x: aval(x, x.sharding), tree)
    return jax.tree.map(aval, tree, shardings)


def bytes_per_device(tree: Any, shardings: Any) -> int:
    """Bytes the largest device holds of ``tree`` (arrays or ShapeDtypeStructs) under
    ``shardings`` (a matching tree of NamedShardings)."""
    leaves = jax.tree.leaves(tree)
    specs = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
    total = 0
    for leaf, sharding in zip(leaves, specs, strict=True):
        shard = sharding.shard_shape(tuple(leaf.shape))  # the rules only shard evenly
        total += math.prod(shard) * np.dtype(leaf.dtype).itemsize
    return total
