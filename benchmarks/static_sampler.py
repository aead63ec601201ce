"""The static-batch sampler: jitted prefill plus a ``lax.while_loop`` decode over a dense cache.

The baseline of the continuous-batching engine (``sampler.py``, ``engine.py``) in
``benchmarks/sampler_bench.py``, built from ``dense_decode.py``'s :func:`prefill`,
:func:`decode_step` and :func:`left_pad`. Every row decodes until the longest row stops, in a
cache ``[B, P + N]`` sized for the whole batch.

Layout. A batch of B prompts of different lengths is left-padded to a bucketed length P (padding
is segment 0, real tokens segment 1, positions 0.. from each row's first real token), so every
row's next token lands in the same cache entry ``P + step`` (``jaxrl/models/kv_cache.py``). The
cache has ``P + N`` entries, N = ``max_new_tokens``. One program is compiled per ``(B, P, N)``;
the sampling parameters and the PRNG key are traced arguments, so changing them never
recompiles (``Sampler.compiles`` counts traces).

Numerics match the trainer (docs/algorithms/accumulation.md §5 and §7): logits come from the
model's own head
(``Transformer.logits``, an fp32 HIGHEST matmul when ``fp32_lm_head``), and the reported
log-prob of a sampled token is ``z[tok] - logsumexp(z)`` with ``z = logits.astype(f32) / T``
over the FULL vocabulary, the quantity ``token_logprobs`` computes in training. top-k / top-p
only decide which token is drawn; they do not renormalise the reported log-prob.

Stopping. Row b stops at its first token in ``eos_ids``; later positions hold ``pad_id`` with
log-prob 0, and the row's cache entries no longer matter (rows never attend to each other). The
loop exits as soon as every row has stopped, or after N steps. (Each step samples, then runs the
model on the sampled token, so the forward of the last step is not used: one wasted step per
call, in exchange for a loop body without a conditional around the cache.)

Placement. With a ``mesh`` (``Sampler(..., mesh=)``) the prompts are split over its batch axes
(data × fsdp, ``jaxrl.runtime.mesh.batch_sharding``): the batch is padded up to a multiple of the
row ranks with empty rows (prompt length 0, stopped from the start, dropped from the result), and
every device decodes its own rows. Parameters stay in the sharding they have (``load_params``
copies them in place; leaves that are not on the mesh's devices are replicated over it), and
XLA partitions the model around them (``jaxrl.runtime.spmd``). Results come back with
``jaxrl.runtime.mesh.to_host``, so every process of a multi-process run gets them all. Without a
mesh everything runs where the parameters are.

Random bits do not depend on the mesh: with ``jax_threefry_partitionable`` (the default in this
jax; the sampler refuses a mesh without it) the bits drawn for row b, vocabulary entry v are a
function of the key and the position (b, v) only, not of how the rows are split or how many
padding rows follow. So one key gives the same completions on one device and on eight.

Weights enter only through :meth:`StaticSampler.load_params` (``sampler_weights.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import Mesh

from jaxrl.data.batching.packing import BucketSpec, pick_bucket
from jaxrl.generate.cache_geometry import batch_bucket
from jaxrl.generate.dense_decode import decode_step, left_pad, prefill
from jaxrl.generate.sampler_weights import SamplerWeights, decode_model
from jaxrl.generate.sampling import SampleResult, SamplingParams, sample_tokens, stop_token_ids
from jaxrl.models.model_config import ModelConfig
from jaxrl.runtime.mesh import to_host
from jaxrl.runtime.spmd import on_mesh, put_replicated, put_rows, row_ranks

__all__ = ["StaticSampler"]


class StaticSampler:
    """Static-batch sampling from a :class:`Transformer`; weights via ``load_params``.

    ``generate(prompts, key)`` left-pads the prompts to a bucketed length P (``prompt_buckets``
    as in ``jaxrl.data.batching.packing.pick_bucket``: None = next power of two) and decodes up to
    ``max_new_tokens`` tokens per row. The key is split once per decode step, so a key fixes
    the result, on any mesh. Compiles once per (B, P), B padded to a multiple of the mesh's row
    ranks; ``compiles`` counts them. ``mesh``: split the prompts over its batch axes (None: run
    where the parameters are).
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        max_new_tokens: int,
        eos_id: int | Sequence[int],
        pad_id: int,
        sampling: SamplingParams | None = None,
        prompt_buckets: BucketSpec = None,
        mesh: Mesh | None = None,
    ):
        if mesh is not None and not jax.config.jax_threefry_partitionable:
            raise ValueError(
                "StaticSampler(mesh=...) needs jax_threefry_partitionable=True (the default), so "
                "that the random bits do not depend on how the batch is split over devices"
            )
        eos_ids = stop_token_ids("StaticSampler", config.vocab_size, eos_id, pad_id)
        if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
            raise ValueError(
                f"StaticSampler: max_new_tokens={max_new_tokens} must be a positive int"
            )
        config, self._graphdef, abstract_params = decode_model(config)
        self.config = config
        self.max_new_tokens = max_new_tokens
        self.eos_ids = eos_ids
        self.pad_id = int(pad_id)
        self.sampling = sampling or SamplingParams()
        self.prompt_buckets = prompt_buckets
        self.mesh = mesh
        self.compiles = 0
        self.weights = SamplerWeights(abstract_params, mesh, owner="StaticSampler")
        self._jitted = jax.jit(self._program, static_argnames="key_impl")

    def load_params(self, params: Any, *, copy: bool = True) -> None:
        """Load a trainer's parameters (``SamplerWeights.load``: a compute-dtype copy, or with
        ``copy=False`` the arrays themselves where the dtype matches)."""
        self.weights.load(params, copy=copy)

    @property
    def _params(self) -> Any:
        return self.weights.params

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        key: jax.Array,
        sampling: SamplingParams | None = None,
    ) -> SampleResult:
        """Sample a completion for every prompt (token-id sequences, each non-empty)."""
        params = self.weights.get()
        if not len(prompts) or any(len(p) == 0 for p in prompts):
            raise ValueError(
                "StaticSampler.generate: need at least one prompt, each with >= 1 token"
            )
        s = sampling or self.sampling
        length = pick_bucket(max(len(p) for p in prompts), self.prompt_buckets, "prompt length P")
        b = len(prompts)
        ranks = row_ranks(self.mesh)
        padded = -(-batch_bucket(b) // ranks) * ranks  # one program per batch bucket
        rows = list(prompts) + [[]] * (padded - b)  # empty rows: stopped from the start
        tokens_BP, lengths_B = left_pad(rows, pad_id=self.pad_id, length=length)
        if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
            key_impl, key_data = str(jax.random.key_impl(key)), jax.random.key_data(key)
        else:  # a raw uint32 key (jax.random.PRNGKey)
            key_impl, key_data = None, key
        rep = lambda x: put_replicated(x, self.mesh)  # noqa: E731
        with on_mesh(self.mesh):
            out = self._jitted(
                params,
                put_rows(tokens_BP, self.mesh),
                put_rows(lengths_B, self.mesh),
                rep(np.asarray(key_data)),
                rep(np.float32(s.temperature)),
                rep(np.int32(s.top_k)),
                rep(np.float32(s.top_p)),
                key_impl=key_impl,
            )
        tokens, logprobs, lengths, truncated, steps = to_host(out)
        return SampleResult(
            tokens=tokens[:b],
            logprobs=logprobs[:b],
            lengths=lengths[:b],
            truncated=truncated[:b],
            prompt_lengths=lengths_B[:b],
            num_steps=int(steps),
        )

    __call__ = generate

    def _program(self, params, tokens_BP, prompt_lengths_B, key_data, *sampling, key_impl):
        self.compiles += 1  # runs only while tracing, i.e. once per compilation
        key = key_data
        if key_impl is not None:
            key = jax.random.wrap_key_data(key_data, impl=key_impl)
        return self._generate(params, tokens_BP, prompt_lengths_B, key, *sampling)

    def _generate(self, params, tokens_BP, prompt_lengths_B, key, temperature, top_k, top_p):
        model = nnx.merge(self._graphdef, params)
        b, p = tokens_BP.shape
        n = self.max_new_tokens
        eos_E = jnp.asarray(self.eos_ids, jnp.int32)
        logits_BV, cache = prefill(model, tokens_BP, prompt_lengths_B, p + n)

        def cond(carry):
            i, done_B = carry[0], carry[6]
            return (i < n) & ~jnp.all(done_B)

        def body(carry):
            i, cache, logits_BV, key, tokens_BN, logprobs_BN, done_B, lengths_B = carry
            key, step_key = jax.random.split(key)
            token_B, logp_B = sample_tokens(step_key, logits_BV, temperature, top_k, top_p)
            token_B = jnp.where(done_B, self.pad_id, token_B)
            logp_B = jnp.where(done_B, 0.0, logp_B)
            tokens_BN = lax.dynamic_update_slice(tokens_BN, token_B[:, None], (0, i))
            logprobs_BN = lax.dynamic_update_slice(logprobs_BN, logp_B[:, None], (0, i))
            lengths_B = lengths_B + (~done_B).astype(jnp.int32)
            done_B = done_B | jnp.any(token_B[:, None] == eos_E[None, :], axis=-1)
            logits_BV, cache = decode_step(model, token_B, prompt_lengths_B + i, cache)
            return i + 1, cache, logits_BV, key, tokens_BN, logprobs_BN, done_B, lengths_B

        carry = (
            jnp.zeros((), jnp.int32),
            cache,
            logits_BV,
            key,
            jnp.full((b, n), self.pad_id, jnp.int32),
            jnp.zeros((b, n), jnp.float32),
            prompt_lengths_B == 0,  # padding rows (empty prompts) are done from the start
            jnp.zeros((b,), jnp.int32),
        )
        steps, _, _, _, tokens_BN, logprobs_BN, done_B, lengths_B = lax.while_loop(
            cond, body, carry
        )
        return tokens_BN, logprobs_BN, lengths_B, ~done_B, steps
