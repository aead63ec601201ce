"""How a token is drawn from next-token logits: temperature, top-k / top-p, and the random bits.

The reported log-prob of a drawn token is ``z[tok] - logsumexp(z)`` with
``z = logits.astype(f32) / T`` over the FULL vocabulary, the quantity ``token_logprobs`` computes
in training (docs/algorithms/accumulation.md §5 and §7). top-k / top-p only decide which token is
drawn; they do not renormalise the reported log-prob.

Random bits. The continuous-batching engine (``engine.py``) draws token t of request r with
:func:`token_key` ``(key, r, t)``, a fold-in chain of the call's key, so the bits do not depend on
which decode slot the request occupies, when it was admitted, how many slots there are, how the
batch was padded, or how the slots are split over devices. The Gumbel noise of a threefry key is
computed here, written out, bit for bit what ``jax.random.gumbel`` gives (:func:`gumbel_max`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = [
    "SampleResult",
    "SamplingParams",
    "filter_logits",
    "first_argmax",
    "gumbel_max",
    "sample_tokens",
    "stop_token_ids",
    "token_key",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How the next token is drawn; none of these fields triggers a recompile."""

    temperature: float = 1.0  # logits are divided by it; 0 = greedy (argmax)
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    top_p: float = 1.0  # keep the smallest top set with mass >= top_p (after top-k); 1 = off

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"SamplingParams.temperature={self.temperature}: must be >= 0")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k={self.top_k}: must be an int >= 0 (0 = off)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p={self.top_p}: must be in (0, 1] (1 = off)")


@dataclasses.dataclass(frozen=True)
class SampleResult:
    """Completions of one ``generate`` call (host numpy), one row per request."""

    tokens: np.ndarray  # int32 [B, N]: generated ids, eos included, pad_id after it
    logprobs: np.ndarray  # float32 [B, N]: log-softmax(logits / T) at the token; 0 after the end
    lengths: np.ndarray  # int32 [B]: generated tokens including the eos / stop token
    truncated: np.ndarray  # bool [B]: stopped by its token limit, without eos or stop string
    prompt_lengths: np.ndarray  # int32 [B]
    num_steps: int  # decode steps run
    compacted_steps: int = 0  # of those, steps run in fewer slots (engine.py, "Compaction")
    weight_version: int = -1  # the version of the weights that generated it (-1: unknown)
    routes: list[np.ndarray] | None = None  # MoE models: int32 [P + len, Lm, K] per row, the
    # experts each prompt and completion token went through; -1 on the last token (never fed);
    # a session's turn (generate/session.py): its new tokens' then its generated tokens'

    @classmethod
    def of(
        cls,
        prompts: Sequence[Sequence[int]],
        tokens: np.ndarray,
        logprobs: np.ndarray,
        lengths: np.ndarray,
        truncated: np.ndarray,
        *,
        num_steps: int | None = None,
        compacted_steps: int = 0,
        weight_version: int = -1,
        routes: list[np.ndarray] | None = None,
    ) -> SampleResult:
        """The result for ``prompts``, one row each: the first ``len(prompts)`` rows of the
        (possibly padded) arrays, ``prompt_lengths`` from the prompts; ``num_steps`` defaults
        to the longest completion (a backend that does not count decode steps)."""
        b = len(prompts)
        lengths = np.asarray(lengths[:b], np.int32)
        return cls(
            tokens=np.asarray(tokens[:b], np.int32),
            logprobs=np.asarray(logprobs[:b], np.float32),
            lengths=lengths,
            truncated=np.asarray(truncated[:b], bool),
            prompt_lengths=np.asarray([len(p) for p in prompts], np.int32),
            num_steps=int(lengths.max(initial=0) if num_steps is None else num_steps),
            compacted_steps=compacted_steps,
            weight_version=weight_version,
            routes=routes,
        )

    @property
    def finish_reasons(self) -> list[str]:
        """Per row, as OpenAI-style APIs say it: ``"length"`` (stopped by its token limit) or
        ``"stop"`` (eos or a stop string)."""
        return ["length" if t else "stop" for t in self.truncated.tolist()]

    def completions(self) -> list[np.ndarray]:
        """Row b's generated ids, ``tokens[b, :lengths[b]]``."""
        return [self.tokens[b, :n] for b, n in enumerate(self.lengths)]


def stop_token_ids(owner: str, vocab_size: int, eos_id: Any, pad_id: int) -> tuple[int, ...]:
    """The eos ids (one id or several) as a tuple, after checking them and ``pad_id`` against
    the vocabulary; ``ValueError`` naming ``owner`` (the sampler class) otherwise."""
    eos_ids = [eos_id] if isinstance(eos_id, int | np.integer) else list(eos_id)
    for name, ids in (("eos_id", eos_ids), ("pad_id", [pad_id])):
        if not ids or any(not 0 <= int(i) < vocab_size for i in ids):
            raise ValueError(f"{owner}: {name}={ids} must be in [0, {vocab_size})")
    return tuple(int(i) for i in eos_ids)


def token_key(key: jax.Array, request: jax.Array, token: jax.Array) -> jax.Array:
    """The key of token ``token`` of request ``request``: ``fold_in(fold_in(key, r), t)``."""
    return jax.random.fold_in(jax.random.fold_in(key, request), token)


def filter_logits(logits_BV: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """``logits`` with ``-inf`` outside the top-k, then top-p (nucleus), set of each row.

    top-k keeps the k largest logits (``top_k <= 0``: all). top-p then keeps, in decreasing
    order, every token whose preceding mass under the renormalised top-k distribution is
    ``< top_p`` (the first token always stays). Tokens tied with the last kept logit are kept
    too. Works for traced ``top_k`` and ``top_p``.
    """
    v = logits_BV.shape[-1]
    sorted_BV = -jnp.sort(-logits_BV, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
    in_top_k_BV = jnp.arange(v)[None, :] < k
    probs_BV = jax.nn.softmax(jnp.where(in_top_k_BV, sorted_BV, -jnp.inf), axis=-1)
    mass_before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
    num_kept_B = jnp.sum(in_top_k_BV & (mass_before_BV < top_p), axis=-1)
    cutoff_B1 = jnp.take_along_axis(sorted_BV, jnp.maximum(num_kept_B, 1)[:, None] - 1, axis=-1)
    return jnp.where(logits_BV >= cutoff_B1, logits_BV, -jnp.inf)


def first_argmax(x_BV: jax.Array) -> jax.Array:
    """``jnp.argmax(x, axis=-1)``, the same index (the first maximum; the first NaN if any), as
    two plain reductions: a max, then a min over the indices that hold it.

    XLA's CPU backend fuses the elementwise work that produces ``x`` into ``argmax``'s
    variadic (value, index) reduction, where it runs as scalar code; a plain max and min keep
    that work in one vectorised loop. For the engine's draw (Gumbel noise over a 49k
    vocabulary at 64 slots) this is 2.7x faster (benchmarks/draw_bench.py).
    """
    v = x_BV.shape[-1]
    m_B1 = jnp.max(x_BV, axis=-1, keepdims=True)
    idx_BV = lax.broadcasted_iota(jnp.int32, x_BV.shape, x_BV.ndim - 1)
    hit_BV = (x_BV == m_B1) | jnp.isnan(x_BV)
    return jnp.min(jnp.where(hit_BV, idx_BV, v), axis=-1)


_THREEFRY_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))


def _threefry2x32(k1: jax.Array, k2: jax.Array, x1: jax.Array, x2: jax.Array):
    """Threefry-2x32 (20 rounds, Salmon et al. 2011), written out round by round: the same
    words as JAX's ``threefry2x32`` primitive. JAX lowers that primitive on CPU as a rolled
    5-iteration loop, one pass over memory per iteration; written out, XLA fuses the whole hash
    into one elementwise loop: 2.1 ms against 37.4 ms for the engine's 64 x 49,152 words on a
    2-core CPU (benchmarks/README.md, "Issue 34, the Gumbel noise written out")."""
    ks = (k1, k2, k1 ^ k2 ^ np.uint32(0x1BD11BDA))
    x1, x2 = x1 + ks[0], x2 + ks[1]
    for i in range(5):
        for r in _THREEFRY_ROTATIONS[i % 2]:
            x1 = x1 + x2
            x2 = x1 ^ ((x2 << np.uint32(r)) | (x2 >> np.uint32(32 - r)))
        x1 = x1 + ks[(i + 1) % 3]
        x2 = x2 + ks[(i + 2) % 3] + np.uint32(i + 1)
    return x1, x2


@functools.partial(jax.jit, static_argnums=1, inline=True)
def _threefry_gumbel_f32(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """``jax.random.gumbel(key, shape, float32)`` for a threefry key, vmapped over the key's
    leading axes (``key.shape`` must prefix ``shape``), bit for bit: the partitionable
    threefry bits (counts = the flat index of each element within one key's draw), the
    mantissa trick of ``jax.random.uniform`` on ``[tiny, 1)``, then ``-log(-log(u))``."""
    data = jax.random.key_data(key)  # uint32 [*key.shape, 2]
    lead = key.ndim
    k1, k2 = (jnp.expand_dims(data[..., i], tuple(range(lead, len(shape)))) for i in (0, 1))
    per_key = shape[lead:]
    counts = jnp.broadcast_to(lax.iota(jnp.uint32, math.prod(per_key)).reshape(per_key), shape)
    b1, b2 = _threefry2x32(k1, k2, jnp.zeros(shape, jnp.uint32), counts)
    mantissa = ((b1 ^ b2) >> np.uint32(32 - 23)) | np.float32(1.0).view(np.uint32)
    floats = lax.bitcast_convert_type(mantissa, jnp.float32) - np.float32(1.0)
    tiny = jnp.float32(np.finfo(np.float32).tiny)
    u = lax.max(tiny, floats * (jnp.float32(1.0) - tiny) + tiny)
    return -jnp.log(-jnp.log(u))


def _fast_gumbel_applies(key: jax.Array, logits_BV: jax.Array) -> bool:
    """The written-out threefry draw reproduces ``jax.random.gumbel`` for: a typed threefry
    key, JAX's default (partitionable) threefry bits, the default ("low") Gumbel mode, float32
    noise, and fewer than 2**32 draws per key."""
    return (
        jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
        and str(jax.random.key_impl(key)) == "threefry2x32"
        and key.ndim <= 1
        and bool(jax.config.jax_threefry_partitionable)
        and not bool(jax.config.jax_high_dynamic_range_gumbel)
        and logits_BV.dtype == jnp.float32
        and math.prod(logits_BV.shape[key.ndim :]) < 2**32
    )


def gumbel_max(key: jax.Array, logits_BV: jax.Array) -> jax.Array:
    """``jax.random.categorical(key, logits_BV, axis=-1)`` (vmapped over rows for per-row keys
    of shape ``[B]``), the same token for the same key: ``argmax(logits + gumbel(key))``, the
    argmax taken by :func:`first_argmax`. For threefry keys and float32 logits the noise is
    :func:`_threefry_gumbel_f32` (the same bits, faster on CPU)."""
    if _fast_gumbel_applies(key, logits_BV):
        noise_BV = _threefry_gumbel_f32(key, logits_BV.shape)
    elif key.ndim == 1 and jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        noise_BV = jax.vmap(lambda k: jax.random.gumbel(k, logits_BV.shape[1:], logits_BV.dtype))(
            key
        )
    else:
        noise_BV = jax.random.gumbel(key, logits_BV.shape, logits_BV.dtype)
    return first_argmax(logits_BV + noise_BV)


def sample_tokens(
    key: jax.Array,
    logits_BV: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """``(tokens_B, logprobs_B)``: one draw per row and its full-vocabulary log-prob.

    ``key``: one key for the whole batch (shape ``()``), or one key per row (shape ``[B]``,
    e.g. from :func:`token_key`). ``z = logits.astype(f32) / temperature``; the token is drawn
    from ``softmax(z)`` restricted by :func:`filter_logits`, and its log-prob is
    ``z[tok] - logsumexp(z)`` over the full vocabulary (as the trainer computes it).
    ``temperature == 0`` is greedy: the argmax of the logits, with the log-prob at temperature 1.
    """
    greedy = temperature == 0
    z_BV = logits_BV.astype(jnp.float32) / jnp.where(greedy, 1.0, temperature)
    filtering = (top_k > 0) | (top_p < 1)
    filtered_BV = lax.cond(
        filtering & ~greedy, lambda z: filter_logits(z, top_k, top_p), lambda z: z, z_BV
    )
    drawn_B = gumbel_max(key, filtered_BV)
    tokens_B = jnp.where(greedy, first_argmax(z_BV), drawn_B).astype(jnp.int32)
    token_logit_B = jnp.take_along_axis(z_BV, tokens_B[:, None], axis=-1)[:, 0]
    return tokens_B, token_logit_B - jax.nn.logsumexp(z_BV, axis=-1)
