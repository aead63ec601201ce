"""The dense projections' matmul, with operands in a narrower dtype than the activations.

``ModelConfig.matmul_dtype`` (docs/precision.md, "Matmul operands"): None runs ``x @ w`` in the
compute dtype. ``"bfloat16"`` under an fp32 compute dtype casts both operands of the
projection matmuls (q, k, v, o, gate, up, down) to bf16 and accumulates in fp32: on a CPU with
AMX-BF16 or AVX512-BF16 that runs on its bf16 matmul instructions (about 3x an fp32 matmul's
rate with AMX, 1.4-2x with AVX512-BF16), while every
elementwise op, norm, softmax, residual and the LM head stay in fp32, where XLA's CPU backend
would emulate bf16 arithmetic. The backward's two matmuls take bf16 operands too (the output's
cotangent cast to bf16, as a bf16 forward's would be), and return fp32 gradients.

Each output element is a function of its own row of ``x`` and of ``w`` only, so the result does
not depend on how rows are batched, packed or split over devices: the layout invariances hold
as in fp32. It differs from the fp32 matmul by bf16 rounding of the operands (a relative
``2^-9`` per operand), like a bf16 compute dtype's matmuls, which also round the activations
between them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

__all__ = ["PROJECTIONS", "matmul"]

# the kernels whose matmul takes ModelConfig.matmul_dtype operands (transformer.py's Attention
# and MLP); the engine stores its copy of them in that dtype (generate/sampler_weights.py)
PROJECTIONS = frozenset(
    ("q_kernel", "k_kernel", "v_kernel", "o_kernel", "gate_kernel", "up_kernel", "down_kernel")
)


def matmul(x: jax.Array, w: jax.Array, operand_dtype: str | None = None) -> jax.Array:
    """``x[..., K] @ w[K, N]`` in ``x``'s dtype; with ``operand_dtype`` narrower than ``x``'s
    dtype, both operands in it, accumulated in fp32 (module doc)."""
    if operand_dtype is None or jnp.dtype(operand_dtype) == x.dtype:
        return x @ w
    return _narrow(x, w, jnp.dtype(operand_dtype).name)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _narrow(x: jax.Array, w: jax.Array, dtype: str) -> jax.Array:
    return _dot(x.astype(dtype), w.astype(dtype)).astype(x.dtype)


def _dot(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.matmul(a, b, preferred_element_type=jnp.float32)


def _narrow_fwd(x: jax.Array, w: jax.Array, dtype: str) -> tuple[jax.Array, tuple]:
    x_n, w_n = x.astype(dtype), w.astype(dtype)
    # the residuals are the narrow operands (half the bytes), and a zero-size array that carries
    # w's dtype (a custom_vjp residual cannot be a dtype object); x's is the output's, g's
    w_tag = jnp.zeros((0,), w.dtype)
    return _dot(x_n, w_n).astype(x.dtype), (x_n, w_n, w_tag)


def _narrow_bwd(dtype: str, residuals: tuple, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    x_n, w_n, w_tag = residuals
    g_n = g.astype(dtype)
    dx = _dot(g_n, w_n.T).astype(g.dtype)
    rows_x, rows_g = x_n.reshape(-1, x_n.shape[-1]), g_n.reshape(-1, g_n.shape[-1])
    dw = _dot(rows_x.T, rows_g).astype(w_tag.dtype)
    return dx, dw


_narrow.defvjp(_narrow_fwd, _narrow_bwd)
