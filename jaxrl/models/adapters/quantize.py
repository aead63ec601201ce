"""The frozen, quantised base of QLoRA: projection kernels stored as int8 or nf4 codes (qwix).

``QuantizedKernel`` replaces a projection's ``nnx.Param`` kernel with qwix's array
quantisation (``qwix.quantize`` / ``qwix.dequantize``, the ``QArray`` of google/qwix, which
tunix uses): the codes and scales are two ``QuantizedParam`` Variables with the kernel's logical
axes, so they are sharded as the kernel is, and ``kernel[...]`` dequantises on the fly, so the
model's forward reads a quantised kernel exactly as it reads a dense one (then casts it to the
compute dtype). Nothing here is trained: ``QuantizedParam`` is not an ``nnx.Param``.

- ``int8``: symmetric absmax per output channel (one scale per output unit, over the input
  axis): ``scale = absmax / 127.5`` (qwix's symmetric bound, so the top bucket is fully used),
  codes ``round(w / scale)`` clipped to ``[-128, 127]``, in ``int8``.
- ``nf4``: QLoRA's 4-bit NormalFloat (Dettmers et al. 2023, appendix E buckets), absmax
  blocks of ``NF4_BLOCK`` = 64 inputs per output unit (bitsandbytes' block size), codes in
  ``uint4``. XLA stores ``uint4`` packed two to a byte on TPU; the memory planner counts
  half a byte per code.

Scales are float32. Only the seven projections (and a MoE block's experts) are quantised;
embeddings, norms, biases, routers and the LM head stay in the compute dtype (as bitsandbytes
leaves them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import qwix
from flax import nnx

from jaxrl.models.fsdp import weight

NF4_BLOCK = 64  # inputs per nf4 scale (bitsandbytes' default blocksize)
QTYPES = {"int8": jnp.int8, "nf4": "nf4"}


class QuantizedParam(nnx.Variable):
    """A frozen quantised value (codes or scales): never a parameter of the optimizer."""


KERNELS = {  # module attribute -> (HF projection name, logical names of its input axes)
    "q_kernel": ("q_proj", ("embed",)),
    "k_kernel": ("k_proj", ("embed",)),
    "v_kernel": ("v_proj", ("embed",)),
    "o_kernel": ("o_proj", ("heads", "head_dim")),
    "gate_kernel": ("gate_proj", ("embed",)),
    "up_kernel": ("up_proj", ("embed",)),
    "down_kernel": ("down_proj", ("mlp",)),
    # the experts of a MoE block (models/moe/layer.py), [E, in, out]: per expert and channel
    "expert_gate_kernel": ("gate_proj", ("embed",)),
    "expert_up_kernel": ("up_proj", ("embed",)),
    "expert_down_kernel": ("down_proj", ("moe_mlp",)),
}


def quantize_array(
    value: jax.Array, axes: tuple[str | None, ...], inputs: tuple[str, ...], mode: str
) -> qwix.QArray:
    """``value`` (a kernel with logical ``axes``, contracted over the ``inputs`` axes) as a qwix
    ``QArray``: int8 with one scale per output unit, nf4 with one per block of ``NF4_BLOCK``
    inputs (along the last input axis) per output unit."""
    in_dims = [axes.index(name) for name in inputs]
    if mode == "int8":
        channels = tuple(i for i in range(value.ndim) if i not in in_dims)
        tiled = None
    else:
        axis = in_dims[-1]
        block = min(NF4_BLOCK, value.shape[axis])
        if value.shape[axis] % block:
            raise ValueError(f"nf4: axis {axis} of {value.shape} is not a multiple of {block}")
        channels = tuple(i for i in range(value.ndim) if i != axis)
        tiled = {axis: block}
    return qwix.quantize(
        value.astype(jnp.float32),
        QTYPES[mode],
        channelwise_axes=channels,
        tiled_axes=tiled,
        scale_dtype=jnp.float32,
    )


class QuantizedKernel(nnx.Module):
    """A kernel stored as qwix codes + scales; ``kernel[...]`` is the dequantised float32 array."""

    def __init__(
        self, value: jax.Array, axes: tuple[str | None, ...], inputs: tuple[str, ...], mode: str
    ):
        q = quantize_array(value, axes, inputs, mode)
        self.qvalue = QuantizedParam(q.qvalue, out_sharding=axes, eager_sharding=False)
        self.scale = QuantizedParam(q.scale, out_sharding=axes, eager_sharding=False)
        self.mode = mode

    def __getitem__(self, index):
        q = qwix.QArray(self.qvalue[...], self.scale[...], None, QTYPES[self.mode])
        return qwix.dequantize(q)[index]

    def gathered(self, dtype) -> jax.Array:
        """The dequantised kernel in ``dtype`` (``fsdp.weight``): codes and scales are gathered
        over fsdp when they are ZeRO-3 shards, then dequantised."""
        q = qwix.QArray(weight(self.qvalue), weight(self.scale), None, QTYPES[self.mode])
        value = qwix.dequantize(q)
        return value if dtype is None else value.astype(dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.qvalue.shape)


def quantize_kernels(module: nnx.Module, mode: str) -> None:
    """Replace, in place, every projection kernel under ``module`` by a ``QuantizedKernel``."""
    if mode == "none":
        return
    for _, sub in list(nnx.iter_modules(module)):
        for name, (_, inputs) in KERNELS.items():
            param = getattr(sub, name, None)
            if isinstance(param, nnx.Param):
                axes = tuple(param.get_metadata()["out_sharding"])
                setattr(sub, name, QuantizedKernel(param[...], axes, inputs, mode))
