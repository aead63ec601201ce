"""Master weights and their compute-dtype copies (docs/precision.md).

The optimizer updates the master weights (``model.param_dtype``, fp32 by default) in fp32;
the forward casts them to the compute dtype (``model.dtype``) where each weight is used. The
sampler and GRPO's frozen reference take a compute-dtype copy once per weight sync
(:func:`compute_copy`), so no program holds two fp32 copies.

A bf16 master is an explicit opt-in (``optimizer.master_rounding``): the fp32 value
``master + update`` is written back either by stochastic rounding (:func:`stochastic_round`:
rounds up with probability equal to the distance from the lower neighbour, so the expected
stored value is the fp32 value and small updates survive on average) or by rounding to
nearest, which loses every update under half an ulp; :func:`lost_update_fraction` estimates
how many elements that is at a given learning rate, for the start-up warning.

``model.dtype: auto`` (:func:`auto_compute_dtype`) picks the compute dtype by backend: bfloat16
where the hardware has bf16 arithmetic (GPU, TPU), float32 on the CPU, where XLA emulates bf16
(a bf16 decode step there runs ~7x slower than fp32, and compiles ~3x longer).

``model.matmul_dtype: auto`` (the default when ``model.dtype`` is auto;
:func:`auto_matmul_dtype`) gives the trainer's projection matmuls bf16 operands with fp32
accumulation where the compute dtype is fp32 and the CPU has bf16 matmul instructions, AMX-BF16
or AVX512-BF16 (``models/matmul.py``): there a bf16 matmul runs at ~3x (AMX) or 1.4-2x
(AVX512-BF16) the fp32 rate, while bf16 elementwise arithmetic is still emulated. The engine
decodes with the same operands, from a bf16 copy of those kernels
(``generate/sampler_weights.decode_model``).
"""

from __future__ import annotations

import functools
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

Rounding = Literal["stochastic", "nearest"]
AUTO = "auto"
EMULATED_BF16 = ("cpu",)  # backends whose bf16 arithmetic is emulated in fp32 by XLA


def auto_compute_dtype(dtype: str | None, platform: str | None = None) -> str | None:
    """``dtype`` itself, or for ``"auto"`` the fast compute dtype of ``platform`` (default: the
    backend jax runs on): ``"float32"`` where bf16 is emulated, else ``"bfloat16"``."""
    if dtype != AUTO:
        return dtype
    platform = platform or jax.default_backend()
    return "float32" if platform in EMULATED_BF16 else "bfloat16"


def auto_matmul_dtype(
    matmul_dtype: str | None, dtype: str | None, platform: str | None = None
) -> str | None:
    """``model.matmul_dtype`` resolved: itself when pinned; for ``"auto"`` (and for None when
    ``dtype`` is ``"auto"``) ``"bfloat16"`` where the compute dtype is fp32 on a CPU with bf16
    matmul instructions (:func:`cpu_has_bf16_matmul`), else None (the compute dtype)."""
    if matmul_dtype not in (None, AUTO):
        return matmul_dtype
    if matmul_dtype is None and dtype != AUTO:
        return None
    platform = platform or jax.default_backend()
    fp32 = auto_compute_dtype(dtype, platform) in (None, "float32")
    return "bfloat16" if platform == "cpu" and fp32 and cpu_has_bf16_matmul() else None


BF16_MATMUL_FLAGS = ("amx_bf16", "avx512_bf16")  # Intel AMX; AVX512-BF16 (Cooper Lake, Zen 4+)


@functools.cache
def cpu_has_bf16_matmul() -> str | None:
    """The first of :data:`BF16_MATMUL_FLAGS` this host's CPU lists (Linux ``/proc/cpuinfo``):
    bf16 dot-product instructions XLA's CPU matmuls use; None without."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split() for line in f if line.startswith("flags")), [])
    except OSError:
        return None
    return next((flag for flag in BF16_MATMUL_FLAGS if flag in flags), None)


def auto_dtype_note(platform: str | None = None, matmul_dtype: str | None = None) -> str:
    """The start-up line that says what ``model.dtype=auto`` resolved to, and why
    (``matmul_dtype``: the resolved ``model.matmul_dtype``, named when it is set)."""
    platform = platform or jax.default_backend()
    chosen = auto_compute_dtype(AUTO, platform)
    why = "bf16 arithmetic is emulated there" if chosen == "float32" else "native bf16"
    note = f"model.dtype=auto: {chosen} compute on {platform} ({why}; pin model.dtype to override)"
    if matmul_dtype is not None and matmul_dtype != chosen:
        flag = cpu_has_bf16_matmul() if platform == "cpu" else None
        note += (
            f"; projection matmuls take {matmul_dtype} operands with fp32 accumulation "
            f"({f'the CPU has {flag.upper()}' if flag else 'model.matmul_dtype'}; "
            "model.matmul_dtype=float32 to turn off)"
        )
    return note


def stochastic_round(x: jax.Array, key: jax.Array, dtype: Any) -> jax.Array:
    """fp32 ``x`` rounded to ``dtype`` (bfloat16), stochastically: up with probability equal to
    the fraction of the gap to the next representable value, so ``E[result] = x``. fp32 values
    are returned as they are; non-finite values are rounded to nearest."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.float32:
        return x.astype(jnp.float32)
    if dtype != jnp.bfloat16:
        raise ValueError(f"stochastic_round: {dtype} is not supported (bfloat16 or float32)")
    x = x.astype(jnp.float32)
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    noise = jax.random.bits(key, x.shape, jnp.uint32) >> 16  # uniform on [0, 2^16)
    # adding noise below bit 16 then truncating rounds away from zero with probability equal
    # to the dropped fraction (sign-magnitude: the same holds for negative values)
    rounded = (bits + noise) & jnp.uint32(0xFFFF0000)
    out = jax.lax.bitcast_convert_type(rounded, jnp.float32).astype(jnp.bfloat16)
    return jnp.where(jnp.isfinite(x), out, x.astype(jnp.bfloat16))


def write_master(params: Any, new32: Any, key: jax.Array, rounding: Rounding | None) -> Any:
    """The updated fp32 values ``new32`` written into masters of ``params``' dtypes: fp32
    masters exactly; lower-precision masters by ``rounding`` (stochastic: one independent key
    per leaf, derived from ``key``)."""
    leaves, treedef = jax.tree.flatten(params)
    news = treedef.flatten_up_to(new32)
    keys = jax.random.split(key, max(len(leaves), 1))
    out = []
    for i, (p, n) in enumerate(zip(leaves, news, strict=True)):
        if p.dtype == jnp.float32 or rounding != "stochastic":
            out.append(n.astype(p.dtype))
        else:
            out.append(stochastic_round(n, keys[i], p.dtype))
    return jax.tree.unflatten(treedef, out)


def lost_update_fraction(params: Any, learning_rate: float) -> float:
    """Fraction of the parameter elements of ``params`` (bf16) whose bf16 spacing is so coarse
    that an AdamW step of size ``learning_rate`` (Adam's normalised update is about lr per
    element) is under half an ulp, so rounding to nearest writes nothing back."""

    @jax.jit
    def counts(tree: Any) -> tuple[jax.Array, jax.Array]:
        lost = jnp.float32(0.0)
        total = jnp.float32(0.0)
        for p in jax.tree.leaves(tree):
            if p.dtype == jnp.float32:
                continue
            a = jnp.abs(p.astype(jnp.float32))
            ulp = jnp.spacing(a.astype(p.dtype)).astype(jnp.float32)
            lost += jnp.sum((learning_rate < ulp / 2).astype(jnp.float32))
            total += a.size
        return lost, total

    lost, total = (float(np.asarray(x)) for x in counts(params))
    return lost / total if total else 0.0


def compute_copy(params: Any, dtype: Any) -> Any:
    """A real copy of ``params`` in the compute ``dtype`` (each leaf keeps its sharding): the
    one cast per weight sync for the sampler or a frozen reference."""
    dtype = jnp.dtype(dtype)
    return _copy(params, dtype)


@functools.partial(jax.jit, static_argnums=1)
def _copy(params: Any, dtype: Any) -> Any:
    # jnp.array(copy=True) is a real copy (jit would forward an unchanged input)
    return jax.tree.map(lambda p: jnp.array(p, dtype=dtype, copy=True), params)
