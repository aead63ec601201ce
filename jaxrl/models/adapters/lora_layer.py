"""The LoRA layer inside the model's projections (``transformer.py``); the model-level
operations (split, disable, merge) are in ``lora.py``, which documents the whole scheme.

``adapter`` creates a projection's ``nnx.LoRA`` (PEFT init, float32, the kernel's logical axes);
``adapt`` adds its scaled output to the projection's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.models.adapters.quantize import KERNELS, quantize_kernels
from jaxrl.models.fsdp import weight
from jaxrl.models.model_config import LoraSpec, ModelConfig

ADAPTERS = {  # kernel attribute -> adapter attribute
    name: name.replace("_kernel", "_lora") for name in KERNELS
}
LORA_SEED_STREAM = 0x4C6F5241  # folded into the params key: adapters draw their own stream


def adapter(
    spec: LoraSpec | None,
    target: str,
    shape: tuple[int, int],
    axes: tuple[str | None, str | None],
    dtype: str,
    rngs: nnx.Rngs | None,
) -> nnx.LoRA | None:
    """The ``nnx.LoRA`` of the projection ``target`` (HF name) from ``shape = (in, out)`` with
    logical ``axes = (in_axis, out_axis)``; None when ``spec`` does not target it."""
    if spec is None or not spec.targets(target):
        return None
    meta = dict(eager_sharding=False)
    return nnx.LoRA(
        shape[0],
        spec.rank,
        shape[1],
        dtype=dtype,
        param_dtype=jnp.float32,
        # PEFT: kaiming_uniform_(a=sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in)); B = 0
        a_initializer=jax.nn.initializers.variance_scaling(1 / 3, "fan_in", "uniform"),
        b_initializer=jax.nn.initializers.zeros,
        rngs=rngs,
        a_metadata=dict(out_sharding=(axes[0], None), **meta),
        b_metadata=dict(out_sharding=(None, axes[1]), **meta),
    )


def adapt(y: jax.Array, lora: nnx.LoRA | None, x: jax.Array, scaling: float) -> jax.Array:
    """``y + scaling · (x A) B`` in the compute dtype (``y`` unchanged without an adapter);
    ``y`` may be the multi-head view of the flat adapter output."""
    if lora is None:
        return y
    # nnx.LoRA.__call__ (promote to its dtype, x @ A @ B) with A and B read through
    # fsdp.weight, so ZeRO-3 shards are gathered
    a, b = weight(lora.lora_a, lora.dtype), weight(lora.lora_b, lora.dtype)
    out = x.astype(lora.dtype) @ a @ b
    return y + (out * scaling).reshape(y.shape).astype(y.dtype)


def lora_rngs(rngs: nnx.Rngs, config: ModelConfig) -> nnx.Rngs | None:
    """The adapters' own random stream (so a seed gives the same base with or without them)."""
    if config.lora is None or config.lora.rank == 0:
        return None
    return nnx.Rngs(params=jax.random.fold_in(rngs.params.key[...], LORA_SEED_STREAM))


def quantize_base(model: nnx.Module, config: ModelConfig) -> None:
    """Quantise ``model``'s projection kernels in place per ``config.lora.quantize``."""
    if config.lora is not None:
        quantize_kernels(model, config.lora.quantize)
