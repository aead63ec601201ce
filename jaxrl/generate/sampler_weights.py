"""The weights a sampler decodes with: a compute-dtype copy, or the trainer's own arrays.

``load(params, copy=True)`` copies each leaf and casts it to the compute dtype
(``ModelConfig.dtype``; fp32 masters are never copied as fp32) in one jitted copy, which never
gathers a sharded state onto one device. A trainer that
donates its buffers cannot invalidate such a copy, so generation may run concurrently with
training (asynchronous GRPO).

With a mesh, the copy is made in the sampler's decode layout (``decode_layout.py``: every
leaf in the shardings the logical rules give on that mesh), a reshard of the trainer's layout.

``load(params, copy=False)`` is the synchronous path: when every leaf already lies in the decode
layout, leaves already in the compute dtype are used as they are, no copy; only leaves in
another dtype are cast (one cast per weight sync, where they lie). Parameters in another layout
(ZeRO-3 shards, another tensor split) are copied into it. The sampler then holds references to the
trainer's arrays until :meth:`SamplerWeights.release` or the next ``load``; a train step that
donates them deletes them, and a ``generate`` on deleted weights is an error that says to load
again, never a read of freed memory.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl.models.model_config import ModelConfig
from jaxrl.models.sharding import state_shardings
from jaxrl.models.transformer import Transformer
from jaxrl.runtime.mesh import put_global, to_host
from jaxrl.runtime.spmd import on_mesh_devices

__all__ = ["SamplerWeights", "sampler_model"]


def sampler_model(config: ModelConfig) -> tuple[ModelConfig, Any, Any]:
    """``(config, graphdef, abstract_params)`` of the model a sampler runs: its parameters in
    the compute dtype (one cast per weight sync, never an fp32 master copy: docs/precision.md),
    built abstractly (no weight is allocated); every matmul in the compute dtype."""
    # the sampler decodes a few rows at a time, memory-bound: its matmuls run in the compute
    # dtype (a narrower matmul_dtype is for the trainer's long rows: models/matmul.py)
    config = dataclasses.replace(config, param_dtype=config.dtype, matmul_dtype=None)
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    graphdef, abstract_params = nnx.split(abstract, nnx.Param)
    return config, graphdef, abstract_params


class SamplerWeights:
    """Holds the parameters a sampler reads, checked against its architecture."""

    def __init__(self, abstract_params: Any, mesh: Mesh | None, owner: str = "Sampler"):
        self.abstract = abstract_params  # nnx.State of ShapeDtypeStructs in the compute dtype
        self.mesh = mesh
        self.owner = owner
        self.params: Any = None
        self.copied = True  # whether ``params`` is the sampler's own copy
        # the copy lands in the decode layout of ``mesh`` (decode_layout.py): one reshard per
        # weight sync, never a gather onto one device
        target = None if mesh is None else state_shardings(abstract_params, mesh)
        self.shardings = target
        self._copy = jax.jit(self._cast_copy, out_shardings=target)

    def load(self, params: Any, *, copy: bool = True) -> None:
        """Take a :class:`Transformer` or its ``nnx.State`` of parameters (see module doc)."""
        if isinstance(params, nnx.Module):
            params = nnx.split(params, nnx.Param)[1]
        want = jax.tree.structure(self.abstract)
        if jax.tree.structure(params) != want:
            raise ValueError(
                f"{self.owner}.load_params: parameter tree does not match the sampler's "
                "architecture; build the sampler from the trainer's ModelConfig.\n got:  "
                f"{jax.tree.structure(params)}\n want: {want}"
            )
        wrong = [
            f"{jax.tree_util.keystr(path)}: {tuple(src.shape)}, expected {tuple(dst.shape)}"
            for (path, dst), src in zip(
                jax.tree.leaves_with_path(self.abstract), jax.tree.leaves(params), strict=True
            )
            if tuple(src.shape) != tuple(dst.shape)
        ]
        if wrong:
            raise ValueError(
                f"{self.owner}.load_params: parameter shape mismatch: " + "; ".join(wrong)
            )
        if self.mesh is not None:  # leaves elsewhere: replicated over the mesh, from the host
            replicated = NamedSharding(self.mesh, P())
            placed = lambda x: on_mesh_devices(x, self.mesh)  # noqa: E731
            params = jax.tree.map(
                lambda x: x if placed(x) else put_global(to_host(x), replicated), params
            )
        if copy or not self._in_layout(params):  # another layout: resharded, so a copy
            self.params, self.copied = self._copy(params), True
            return
        # no copy: the trainer's arrays where the dtype already matches, a cast elsewhere
        self.params = jax.tree.map(
            lambda dst, src: src if src.dtype == dst.dtype else jnp.asarray(src, dst.dtype),
            self.abstract,
            params,
        )
        self.copied = False

    def _in_layout(self, params: Any) -> bool:
        """Whether every leaf already lies in the decode layout (without a mesh: wherever)."""
        if self.shardings is None:
            return True
        targets = jax.tree.leaves(self.shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
        return all(
            isinstance(x, jax.Array) and x.sharding.is_equivalent_to(t, x.ndim)
            for x, t in zip(jax.tree.leaves(params), targets, strict=True)
        )

    def release(self) -> None:
        """Drop the weights (references to a trainer's arrays included)."""
        self.params = None

    def get(self) -> Any:
        """The loaded parameters; a clear error when none are loaded or they were donated."""
        if self.params is None:
            raise RuntimeError(
                f"{self.owner} has no weights: call sampler.load_params(params) first"
            )
        if any(x.is_deleted() for x in jax.tree.leaves(self.params) if isinstance(x, jax.Array)):
            raise RuntimeError(
                f"{self.owner}: the weights loaded without a copy were donated by a train step; "
                "call sampler.load_params(params) again with the current parameters"
            )
        return self.params

    def _cast_copy(self, params: Any) -> Any:
        # jnp.array(copy=True) is a real copy (jit would forward an unchanged input); the
        # outputs land in ``self.shardings`` (the decode layout) or, without a mesh, keep the
        # inputs' shardings
        return jax.tree.map(
            lambda dst, src: jnp.array(src, dtype=dst.dtype, copy=True), self.abstract, params
        )
