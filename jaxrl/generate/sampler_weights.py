"""The weights a sampler decodes with: a compute-dtype copy, or the trainer's own arrays.

The engine decodes the model :func:`decode_model` describes: layers unrolled whatever the
trainer's layout (a stacked trainer's layers are sliced apart in the weight sync's copy), and
the projection kernels stored in ``ModelConfig.matmul_dtype`` when it is set. Measured on a
2-core AMX CPU (SmolLM2-135M, 64 slots): 261 -> 340 tokens/s (benchmarks/README.md).

``load(params, copy=True)`` copies each leaf and casts it to the compute dtype
(``ModelConfig.dtype``; fp32 masters are never copied as fp32) in one jitted copy, which never
gathers a sharded state onto one device. A trainer that
donates its buffers cannot invalidate such a copy, so generation may run concurrently with
training (asynchronous GRPO).

With a mesh, the copy is made in the sampler's decode layout (``decode_layout.py``: every
leaf in the shardings the logical rules give on that mesh), a reshard of the trainer's layout.

``load(params, copy=False)`` is the synchronous path: when every leaf already lies in the decode
layout (unrolled layers among it), leaves already in the compute dtype are used as they are, no
copy; only leaves in
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

from jaxrl.models.matmul import PROJECTIONS
from jaxrl.models.model_config import ModelConfig
from jaxrl.models.sharding import avals, state_shardings
from jaxrl.models.transformer import Transformer
from jaxrl.runtime.compile_options import program_options
from jaxrl.runtime.mesh import put_global, to_host
from jaxrl.runtime.spmd import on_mesh_devices

__all__ = ["SamplerWeights", "decode_model", "reads_trainer_arrays", "sampler_model"]


def sampler_model(config: ModelConfig) -> tuple[ModelConfig, Any, Any]:
    """``(config, graphdef, abstract_params)`` of the model whose weights leave for another
    engine (the vLLM backend): the trainer's layer layout, every parameter in the compute dtype
    (one cast per weight sync, never an fp32 master copy: docs/precision.md), built abstractly
    (no weight is allocated); every matmul in the compute dtype."""
    config = dataclasses.replace(config, param_dtype=config.dtype, matmul_dtype=None)
    return _abstract(config)


def decode_model(config: ModelConfig, *, scan_layers: bool = False) -> tuple[ModelConfig, Any, Any]:
    """``(config, graphdef, abstract_params)`` of the model the engine decodes with.

    - Layers unrolled (``scan_layers=False``, the default): a layer scan slices each layer's
      weights out of the stacked arrays at every decode step, a copy of the whole model per
      generated token; unrolled, each layer reads its own arrays. The compiled program holds
      one copy of the block per layer (longer compiles).
    - The projection kernels (q, k, v, o, gate, up, down) stored in ``ModelConfig.matmul_dtype``
      when it is set (bf16 operands under fp32 compute, ``models/matmul.py``): the matmuls read
      the narrow copy, never cast per step; every other parameter in the compute dtype.
    """
    config = dataclasses.replace(config, param_dtype=config.dtype, scan_layers=scan_layers)
    config, graphdef, abstract = _abstract(config)
    if config.matmul_dtype is not None:
        narrow = jnp.dtype(config.matmul_dtype)
        abstract = jax.tree_util.tree_map_with_path(
            lambda path, x: (
                jax.ShapeDtypeStruct(x.shape, narrow) if _name(path) in PROJECTIONS else x
            ),
            abstract,
        )
    return config, graphdef, abstract


def reads_trainer_arrays(config: ModelConfig, *, scan_layers: bool = False) -> bool:
    """Whether :func:`decode_model` (with ``scan_layers``) keeps the trainer's parameters as
    they are: same tree and dtypes, so a synchronous weight sync (``load(copy=False)``) reads
    the trainer's arrays in place when they lie in the decode layout. It does when the compute
    dtype is the parameter dtype, no narrower ``matmul_dtype`` is set, and the trainer's layers
    are unrolled or decoded in their scan."""
    return (
        config.dtype == config.param_dtype
        and config.matmul_dtype is None
        and (not config.scan_layers or scan_layers)
    )


def _abstract(config: ModelConfig) -> tuple[ModelConfig, Any, Any]:
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    graphdef, abstract_params = nnx.split(abstract, nnx.Param)
    return config, graphdef, abstract_params


def _name(path: tuple) -> Any:
    """The parameter's own name: the last key before the Variable's ``.value``."""
    keys = [getattr(k, "key", None) for k in path]
    return next((k for k in reversed(keys) if isinstance(k, str)), None)


def _stacked(path: tuple) -> tuple[str, int] | None:
    """``(path of the stacked array, layer)`` of an unrolled layer's parameter
    (``['layers'][i]...`` -> ``['layers']...``, i); None for any other parameter."""
    keys = [getattr(k, "key", None) for k in path]
    if len(keys) > 1 and keys[0] == "layers" and isinstance(keys[1], int):
        return jax.tree_util.keystr(path[:1] + path[2:]), keys[1]
    return None


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
        self._copy = jax.jit(
            self._cast_copy,
            static_argnums=(1,),
            out_shardings=target,
            compiler_options=program_options(),
        )

    def load(self, params: Any, *, copy: bool = True) -> None:
        """Take a :class:`Transformer` or its ``nnx.State`` of parameters (see module doc)."""
        if isinstance(params, nnx.Module):
            params = nnx.split(params, nnx.Param)[1]
        sources, plan = self._plan(params)
        wrong = [
            f"{jax.tree_util.keystr(path)}: {tuple(src.shape)[layer >= 0 :]}, "
            f"expected {tuple(dst.shape)}"
            for (path, dst), (i, layer) in zip(
                jax.tree.leaves_with_path(self.abstract), plan, strict=True
            )
            if (src := sources[i]).shape[layer >= 0 :] != tuple(dst.shape)
        ]
        if wrong:
            raise ValueError(
                f"{self.owner}.load_params: parameter shape mismatch: " + "; ".join(wrong)
            )
        if self.mesh is not None:  # leaves elsewhere: replicated over the mesh, from the host
            replicated = NamedSharding(self.mesh, P())
            placed = lambda x: on_mesh_devices(x, self.mesh)  # noqa: E731
            sources = [x if placed(x) else put_global(to_host(x), replicated) for x in sources]
        restacked = any(layer >= 0 for _, layer in plan)
        if copy or restacked or not self._in_layout(sources):  # another layout: a copy
            self.params, self.copied = self._copy(sources, plan), True
            return
        # no copy: the trainer's arrays where the dtype already matches, a cast elsewhere
        self.params = jax.tree.unflatten(
            jax.tree.structure(self.abstract),
            [
                src if src.dtype == dst.dtype else jnp.asarray(src, dst.dtype)
                for dst, src in zip(jax.tree.leaves(self.abstract), sources, strict=True)
            ],
        )
        self.copied = False

    def _plan(self, params: Any) -> tuple[list[Any], tuple[tuple[int, int], ...]]:
        """``(source leaves, plan)``: for each of the sampler's parameters, in order, the index
        of its source leaf and the layer to take from it (-1: the whole leaf). A trainer with
        stacked layers (``scan_layers``) feeds an unrolled sampler (``decode_model``) layer by
        layer; any other difference of the trees is an error."""
        sources = jax.tree.leaves(params)
        if jax.tree.structure(params) == jax.tree.structure(self.abstract):
            return sources, tuple((i, -1) for i in range(len(sources)))
        paths = [jax.tree_util.keystr(p) for p, _ in jax.tree.leaves_with_path(params)]
        index = {p: i for i, p in enumerate(paths)}
        plan = []
        for path, _ in jax.tree.leaves_with_path(self.abstract):
            stacked = _stacked(path)
            if stacked is not None and stacked[0] in index:
                plan.append((index[stacked[0]], stacked[1]))
            elif (key := jax.tree_util.keystr(path)) in index and stacked is None:
                plan.append((index[key], -1))
            else:
                raise ValueError(
                    f"{self.owner}.load_params: parameter tree does not match the sampler's "
                    f"architecture (no {key if stacked is None else stacked[0]}); build the "
                    f"sampler from the trainer's ModelConfig.\n got:  "
                    f"{jax.tree.structure(params)}\n want: {jax.tree.structure(self.abstract)}"
                )
        if len(plan) and len({i for i, _ in plan}) != len(sources):
            raise ValueError(
                f"{self.owner}.load_params: parameter tree does not match the sampler's "
                "architecture (parameters the sampler has no place for); build the sampler "
                "from the trainer's ModelConfig"
            )
        return sources, tuple(plan)

    def _in_layout(self, params: Any) -> bool:
        """Whether every leaf already lies in the decode layout (without a mesh: wherever)."""
        if self.shardings is None:
            return True
        targets = jax.tree.leaves(self.shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
        return all(
            isinstance(x, jax.Array) and x.sharding.is_equivalent_to(t, x.ndim)
            for x, t in zip(jax.tree.leaves(params), targets, strict=True)
        )

    def lower_copy(self, params: Any) -> Any:
        """The weight copy :meth:`load` runs, lowered for ``params`` (avals of the trainer's
        parameters) without running it: a target compile's view of one weight sync."""
        sources, plan = self._plan(params)
        return self._copy.lower(sources, plan)

    def abstract_loaded(self) -> Any:
        """What :meth:`get` will return after a load, as avals: the decode layout's shardings
        with a mesh; without one the shardings are the loaded arrays' own, so left open."""
        return avals(self.abstract, self.shardings)

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

    def _cast_copy(self, sources: list[Any], plan: tuple[tuple[int, int], ...]) -> Any:
        # jnp.array(copy=True) is a real copy (jit would forward an unchanged input); the
        # outputs land in ``self.shardings`` (the decode layout) or, without a mesh, keep the
        # inputs' shardings; a stacked source gives each layer its slice (``_plan``)
        leaves = [
            jnp.array(sources[i] if layer < 0 else sources[i][layer], dtype=dst.dtype, copy=True)
            for dst, (i, layer) in zip(jax.tree.leaves(self.abstract), plan, strict=True)
        ]
        return jax.tree.unflatten(jax.tree.structure(self.abstract), leaves)
