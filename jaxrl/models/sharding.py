"""Logical axis names to mesh axes: one rule table for the whole package.

Parameters carry logical names in their ``out_sharding`` metadata (``transformer.py``);
arrays in batches use ``batch``. Only the data axis is used today: parameters are replicated
and batches split over ``data``. Sharding a parameter axis later is a one-line rule change.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

LogicalRules = tuple[tuple[str, str | None], ...]

LOGICAL_AXIS_RULES: LogicalRules = (
    ("batch", "data"),
    ("vocab", None),
    ("embed", None),
    ("mlp", None),
    ("heads", None),
    ("kv_heads", None),
    ("head_dim", None),
)


def logical_to_spec(
    logical_axes: Sequence[str | None], rules: LogicalRules = LOGICAL_AXIS_RULES
) -> PartitionSpec:
    """PartitionSpec for an array whose axes have these logical names (None = unsharded)."""
    table = dict(rules)
    unknown = [name for name in logical_axes if name is not None and name not in table]
    if unknown:
        raise ValueError(
            f"logical axes {unknown} have no rule; add them to the rules {sorted(table)}"
        )
    return PartitionSpec(*(None if name is None else table[name] for name in logical_axes))


def _variable_spec(variable: nnx.Variable, rules: LogicalRules) -> PartitionSpec:
    axes = variable.get_metadata().get("out_sharding")
    if not axes:
        return PartitionSpec()
    if len(axes) != len(variable.shape):
        raise ValueError(
            f"out_sharding {axes} names {len(axes)} axes for a value of shape {variable.shape}"
        )
    return logical_to_spec(axes, rules)


def state_partition_specs(state: Any, rules: LogicalRules = LOGICAL_AXIS_RULES) -> Any:
    """The state's tree with every Variable's value replaced by its PartitionSpec.

    Works on concrete or abstract (``nnx.eval_shape``) states; Variables without logical
    metadata are replicated.
    """
    return jax.tree.map(
        lambda v: v.replace(_variable_spec(v, rules)),
        state,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )


def state_shardings(state: Any, mesh: Mesh, rules: LogicalRules = LOGICAL_AXIS_RULES) -> Any:
    """NamedShardings for ``state`` under ``mesh``: pass to ``jax.device_put`` or ``jax.jit``."""
    return jax.tree.map(
        lambda v: v.replace(NamedSharding(mesh, _variable_spec(v, rules))),
        state,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )
