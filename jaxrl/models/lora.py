"""Low-rank adapters (LoRA, rsLoRA, QLoRA) on the projections of a :class:`Transformer`.

A targeted projection ``y = x W`` becomes ``y = x W + scaling · (x A) B`` (PEFT's ``LoraLayer``,
Hu et al. 2021): ``A [in, r]`` and ``B [r, out]`` are the ``lora_a`` / ``lora_b`` of flax's
``nnx.LoRA`` (``nnx.LoRAParam`` Variables, float32), initialised as PEFT does (``A``
kaiming-uniform with bound ``1/sqrt(in)``, ``B`` zero), so a fresh adapter adds an exact zero
and the first forward is the base model's. ``scaling = alpha / r`` (rsLoRA: ``alpha / sqrt(r)``).
Multi-head kernels are adapted on their flattened ``[D, H·Dh]`` / ``[H·Dh, D]`` views, as HF's
``nn.Linear`` weights are. Adapters carry the logical axes of the kernel they adapt (the rank
axis unsharded), so they are sharded over the mesh as it is; with ``scan_layers`` they are
stacked on the layer axis like every block parameter.

A LoRA model's state splits in two (:func:`split_adapters`): the adapters (what is trained,
optimised and checkpointed) and the frozen base (everything else, in the compute dtype;
projection kernels quantised with ``lora.quantize``, ``quantize.py``). ``nnx.merge(graphdef,
adapters, frozen)`` is the model. Three derived views serve the rest of the run:

- :func:`disabled`: the adapters zeroed. The model with them is the base model exactly
  (``y + 0``), the reference of DPO and GRPO with β > 0: same program, same frozen weights, no
  second copy (zeroed adapters, adapter-sized, are all it adds).
- :func:`merge`: a plain dense model (``W + scaling · A B`` per targeted kernel, quantised
  kernels dequantised), for the sampler (one merge per weight sync) and for the HF export.
- :func:`dense_config`: the ``ModelConfig`` of that dense model.

The layer itself (``nnx.LoRA`` creation and the added branch) is in ``lora_layer.py``; the
quantised base in ``quantize.py``; the PEFT directory format in ``peft.py``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.models.adapters.lora_layer import ADAPTERS, quantize_base
from jaxrl.models.adapters.quantize import QuantizedParam
from jaxrl.models.model_config import LoraSpec, ModelConfig
from jaxrl.models.transformer import Transformer


def dense_config(config: ModelConfig) -> ModelConfig:
    """The plain model's config: no adapters, no quantisation (merged weights' architecture)."""
    return dataclasses.replace(config, lora=None)


def with_adapters(model: nnx.Module, spec: LoraSpec, *, seed: int = 0) -> nnx.Module:
    """``model`` (a plain ``Transformer``) with fresh adapters of ``spec`` (PEFT init, drawn from
    ``seed``) and its kernels quantised per ``spec.quantize``; ``model`` is left unchanged.
    Eager and unsharded, for notebooks and tests; runs build theirs in ``jaxrl.train.build``."""
    config = dataclasses.replace(model.config, lora=spec)
    fresh = nnx.eval_shape(lambda: _transformer(config, seed))
    base_graphdef, base_state = nnx.split(model)

    def build(state: nnx.State) -> tuple[nnx.State, nnx.State]:
        base = nnx.merge(base_graphdef, state)
        quantize_base(base.layers, config)
        return split_adapters(_transformer(config, seed))[0], nnx.state(base)

    adapters, frozen = jax.jit(build)(base_state)
    return nnx.merge(nnx.graphdef(fresh), adapters, frozen)


def split_adapters(model_or_state: Any) -> tuple[nnx.State, nnx.State]:
    """``(adapters, frozen)``: the ``nnx.LoRAParam`` Variables and everything else."""
    state = model_or_state
    if isinstance(model_or_state, nnx.Module):
        state = nnx.state(model_or_state)
    return nnx.split_state(state, nnx.LoRAParam, ...)


def join(adapters: nnx.State, frozen: nnx.State) -> nnx.State:
    """The whole model state (no copy): what ``nnx.merge(graphdef, state)`` takes."""
    return nnx.merge_state(frozen, adapters)


def disabled(adapters: nnx.State) -> nnx.State:
    """The adapters with ``B`` (and ``A``) zeroed: the model with them is the base, exactly."""
    return jax.tree.map(jnp.zeros_like, adapters)


def frozen_copy(frozen: nnx.State, dtype: Any) -> nnx.State:
    """The frozen base in the compute ``dtype`` (quantised codes and scales as they are)."""
    dtype = jnp.dtype(dtype)

    def cast(v: Any) -> Any:
        if isinstance(v, QuantizedParam) or not jnp.issubdtype(v.dtype, jnp.floating):
            return v
        return v.replace(v[...].astype(dtype))

    return jax.tree.map(cast, frozen, is_leaf=lambda x: isinstance(x, nnx.Variable))


def merge(model: nnx.Module, dtype: Any | None = None) -> nnx.Module:
    """A dense copy of ``model`` (``dense_config``): every targeted kernel ``W + scaling · A B``
    computed in float32 (quantised kernels dequantised first), every leaf cast to ``dtype``
    (None: the model's ``param_dtype``). A model without adapters or quantisation is returned
    as it is. Jit it (:func:`merged_state`) to merge on the devices, shard by shard."""
    config = model.config
    if config.lora is None:
        return model
    dtype = jnp.dtype(dtype or config.param_dtype)
    scaling = config.lora.scaling if config.lora.rank else 0.0
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: _transformer(dense_config(config))))
    modules = dict(nnx.iter_modules(model))
    source = {_key(p): v for p, v in _variables(nnx.state(model))}

    def value(path: tuple[Any, ...], v: nnx.Variable) -> nnx.Variable:
        path = _key(path)
        *owner, name = path
        if name not in ADAPTERS:
            x = source[path][...]
            return v.replace(x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x)
        sub = modules[tuple(owner)]
        w32 = getattr(sub, name)[...].astype(jnp.float32)
        lora = getattr(sub, ADAPTERS[name], None)
        if lora is not None:
            a, b = lora.lora_a[...].astype(jnp.float32), lora.lora_b[...].astype(jnp.float32)
            w32 = w32 + scaling * jnp.matmul(a, b, precision="highest").reshape(w32.shape)
        return v.replace(w32.astype(dtype))

    state = jax.tree_util.tree_map_with_path(value, abstract, is_leaf=_is_variable)
    return nnx.merge(graphdef, state)


def merged_state(graphdef: Any, state: nnx.State, dtype: Any) -> nnx.State:
    """The state of :func:`merge` of ``nnx.merge(graphdef, state)`` in ``dtype``, computed under
    ``jit`` (the sampler's one merge per weight sync)."""
    return _merged_state(graphdef, state, jnp.dtype(dtype).name)


@functools.partial(jax.jit, static_argnums=(0, 2))
def _merged_state(graphdef: Any, state: nnx.State, dtype: str) -> nnx.State:
    return nnx.state(merge(nnx.merge(graphdef, state), dtype))


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def _variables(state: Any) -> list[tuple[Any, nnx.Variable]]:
    return jax.tree_util.tree_leaves_with_path(state, is_leaf=_is_variable)


def _key(path: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(getattr(p, "key", getattr(p, "idx", p)) for p in path)


def _transformer(config: ModelConfig, seed: int = 0) -> nnx.Module:
    return Transformer(config, rngs=nnx.Rngs(params=seed))


__all__ = [
    "dense_config",
    "disabled",
    "frozen_copy",
    "join",
    "merge",
    "merged_state",
    "split_adapters",
    "with_adapters",
]
