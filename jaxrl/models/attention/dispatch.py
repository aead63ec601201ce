"""Which attention implementation runs: ``model.attention_impl`` resolved for the backend.

``xla`` is the dense reference (``attention.py``), ``flash`` the blockwise kernel
(``flash_attention.py``), ``splash`` / ``pallas_gpu`` the Pallas kernels
(``pallas_attention.py``); all take and return the same arrays.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax

from jaxrl.models.attention import pallas as pallas_attention
from jaxrl.models.attention.dense import attention
from jaxrl.models.attention.flash import flash_attention
from jaxrl.models.model_config import ATTENTION_IMPLS
from jaxrl.runtime.targets import target_platform

_NEEDS_BACKEND = {"splash": "tpu", "pallas_gpu": "gpu"}
AttentionFn = Callable[..., jax.Array]


def resolve_attention_impl(impl: str, backend: str | None = None) -> str:
    """The implementation ``impl`` runs on ``backend`` (default: JAX's default backend).

    ``auto`` is ``splash`` on TPU, ``pallas_gpu`` on GPU and ``flash`` on CPU (on the tiny
    configs flash is as fast as xla at T=256 and far faster for long, sparsely filled rows:
    benchmarks/README.md). A Pallas kernel asked for on another backend is an error.
    """
    if impl not in ATTENTION_IMPLS:
        raise ValueError(
            f"model.attention_impl={impl!r} is invalid: use one of {', '.join(ATTENTION_IMPLS)}"
        )
    backend = backend or target_platform()  # a target compile's platform (runtime/targets)
    if impl == "auto":
        return {"tpu": "splash", "gpu": "pallas_gpu"}.get(backend, "flash")
    needs = _NEEDS_BACKEND.get(impl)
    if needs is not None and backend != needs:
        raise ValueError(
            f"model.attention_impl={impl!r} needs a {needs.upper()} but JAX's backend is "
            f"{backend!r}: use 'auto' (the best for the backend), 'flash' or 'xla'"
        )
    return impl


def attention_fn(
    impl: str,
    *,
    self_attention: bool = True,
    block_size: int = 128,
    interpret: bool = False,
) -> AttentionFn:
    """An ``attention``-compatible function for ``model.attention_impl=impl``.

    ``self_attention=False`` is the KV-cache path (queries against a longer cache, L != T):
    the Pallas kernels mask by index, not position, so there ``auto``, ``splash`` and
    ``pallas_gpu`` use ``xla`` (a decode step's T x L scores are small, and on CPU xla and
    flash are within ~1.5x of each other there); ``flash`` stays flash. ``interpret=True``
    runs a Pallas kernel in interpret mode on any backend (tests).
    """
    if interpret and impl in _NEEDS_BACKEND:
        resolved = impl
    else:
        resolved = resolve_attention_impl(impl)
    if resolved == "xla" or (not self_attention and impl != "flash"):
        return attention
    if resolved == "flash":
        return functools.partial(flash_attention, block_size=block_size)
    kernel = pallas_attention.splash if resolved == "splash" else pallas_attention.pallas_gpu
    return functools.partial(kernel, block_size=block_size, interpret=interpret)
