"""Dense-cache decoding building blocks: left-pad prompts, prefill them into a
:class:`KVCache`, then one cached step per token.

The plain reference decode the continuous-batching engine (``engine.py``) and the attention
kernels are tested against, and the static-batch sampler of ``benchmarks/static_sampler.py`` is
built from. Left-padding puts every row's next token at the same cache entry ``P + step``
(``jaxrl/models/kv_cache.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.models.kv_cache import KVCache
from jaxrl.models.transformer import Transformer

__all__ = ["decode_step", "left_pad", "prefill"]


def left_pad(
    prompts: Sequence[Sequence[int]], *, pad_id: int, length: int
) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens_BP, prompt_lengths_B)``: prompts right-aligned in int32 rows of ``length``."""
    lengths_B = np.asarray([len(p) for p in prompts], np.int32)
    tokens_BP = np.full((len(prompts), length), pad_id, np.int32)
    for b, prompt in enumerate(prompts):
        if len(prompt):
            tokens_BP[b, length - len(prompt) :] = np.asarray(prompt)
    return tokens_BP, lengths_B


def prefill(
    model: Transformer, tokens_BP: jax.Array, prompt_lengths_B: jax.Array, cache_length: int
) -> tuple[jax.Array, KVCache]:
    """Run left-padded prompts into a fresh cache of ``cache_length`` entries.

    Returns the logits of each row's last prompt token ``[B, V]`` (the next-token
    distribution) and the cache with index P.
    """
    b, p = tokens_BP.shape
    pad_B1 = (p - prompt_lengths_B)[:, None]
    idx_1P = jnp.arange(p, dtype=jnp.int32)[None, :]
    segment_ids_BP = (idx_1P >= pad_B1).astype(jnp.int32)
    positions_BP = jnp.maximum(idx_1P - pad_B1, 0)
    cache = KVCache.empty(model.config, b, cache_length)
    hidden_BPD, cache = model.decode(tokens_BP, positions_BP, segment_ids_BP, cache)
    return model.logits(hidden_BPD[:, -1:])[:, 0], cache


def decode_step(
    model: Transformer, tokens_B: jax.Array, positions_B: jax.Array, cache: KVCache
) -> tuple[jax.Array, KVCache]:
    """One token per row at the cache's index (segment 1): ``(next logits [B, V], cache)``."""
    ones_B1 = jnp.ones((tokens_B.shape[0], 1), jnp.int32)
    hidden_B1D, cache = model.decode(tokens_B[:, None], positions_B[:, None], ones_B1, cache)
    return model.logits(hidden_B1D)[:, 0], cache
