"""Per-rank programs: the ``shard_map`` the train step and the scorer run in, and the ZeRO-3
specs of the trees that enter it as their fsdp shards.

Both programs (``accumulate.py``, ``score.py``) are manual over the batch axes
(``jaxrl.runtime.spmd.manual_batch_axes``: ``data``, ``fsdp``; ``tensor`` stays automatic, so
XLA partitions the model's matmuls over heads / MLP units / vocabulary) and see one rank's rows.
With none of those axes larger than 1 there is no ``shard_map``: XLA partitions the whole
program (:func:`per_rank_map`).

ZeRO-3: where ``fsdp`` is a manual axis and a tree's PartitionSpecs are known
(:func:`as_shards`), the tree enters as its fsdp shards (:func:`fsdp_in_specs`: each spec's
``fsdp`` entry kept, every other axis dropped) and reaches the model marked for gathering
(:func:`marked`, ``jaxrl.models.fsdp``): the model all-gathers each weight where it uses it and
the gather's transpose reduce-scatters its gradient. A tree that does not enter as shards
enters whole (``P()``: replicated over the batch axes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxrl.models.fsdp import mark_sharded
from jaxrl.runtime.mesh import FSDP_AXIS
from jaxrl.runtime.spmd import manual_batch_axes

__all__ = [
    "as_shards",
    "fsdp_dim",
    "fsdp_dims",
    "fsdp_in_specs",
    "in_specs_of",
    "is_spec",
    "marked",
    "per_rank_map",
]


def is_spec(x: Any) -> bool:
    """A PartitionSpec (the leaves of a specs tree)."""
    return isinstance(x, P)


def fsdp_dim(spec: P) -> int | None:
    """The dimension a parameter's PartitionSpec shards over ``fsdp`` (None: not sharded)."""
    for dim, entry in enumerate(spec):
        names = (entry,) if isinstance(entry, str) else tuple(entry or ())
        if FSDP_AXIS in names:
            return dim
    return None


def fsdp_dims(specs: Any) -> list[int | None]:
    """:func:`fsdp_dim` of every PartitionSpec of a tree, in leaf order."""
    return [fsdp_dim(s) for s in jax.tree.leaves(specs, is_leaf=is_spec)]


def fsdp_in_specs(specs: Any) -> Any:
    """``shard_map`` in_specs of ZeRO-3 shards: each spec's ``fsdp`` entry kept, every other
    axis (``tensor`` is automatic) dropped."""
    return jax.tree.map(
        lambda s: P(*(FSDP_AXIS if d == fsdp_dim(s) else None for d in range(len(s)))),
        specs,
        is_leaf=is_spec,
    )


def as_shards(specs: Any | None, manual: tuple[str, ...]) -> bool:
    """Whether a tree with these PartitionSpecs enters a per-rank program as its fsdp shards
    (ZeRO-3): fsdp is a manual axis and the specs are known."""
    return FSDP_AXIS in manual and specs is not None


def in_specs_of(specs: Any | None, manual: tuple[str, ...]) -> Any:
    """A tree's ``shard_map`` in_specs: its fsdp shards' (:func:`fsdp_in_specs`) where it
    enters as such (:func:`as_shards`), else whole (``P()``)."""
    return fsdp_in_specs(specs) if as_shards(specs, manual) else P()


def marked(tree: Any, specs: Any | None, manual: tuple[str, ...]) -> Any:
    """Inside a per-rank program: ``tree``'s fsdp shards marked for the model to gather
    (``jaxrl.models.fsdp``); ``tree`` itself when it enters whole."""
    if tree is None or not as_shards(specs, manual):
        return tree
    return mark_sharded(tree, fsdp_dims(specs), FSDP_AXIS)


def per_rank_map(
    fn: Callable[..., Any], mesh: Mesh | None, *, in_specs: Any, out_specs: Any
) -> Callable[..., Any]:
    """``fn`` as one program per rank: ``shard_map`` manual over ``mesh``'s batch axes
    (``in_specs`` / ``out_specs`` name only those), ``tensor`` automatic; ``fn`` itself when
    there is no manual axis (no mesh, or one rank over several tensor devices: XLA partitions
    the whole program)."""
    manual = () if mesh is None else manual_batch_axes(mesh)
    if not manual:
        return fn
    return jax.shard_map(
        fn,
        mesh=mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        axis_names=set(manual),
        check_vma=False,
    )
