"""Continuous batching: one compiled program that prefills prompt groups and decodes requests in
a fixed number of slots, refilling a slot as soon as its request stops.

Requests and groups. A call holds R requests (completions to generate) over Q distinct prompts
(groups): request r continues prompt ``group[r]``. The Q prompts are prefilled once each, right
padded to P tokens (chunks of C tokens when ``prefill_chunk`` is set), into a prompt cache
``[Nl, Q, P, K, Dh]`` (``kv_cache.KVCache``) together with each prompt's next-token logits; the
G completions of a prompt share that one prefill.

Slots. S decode slots share a slot-contiguous cache ``[Nl, S, L, K, Dh]``
(``models/slot_kv_cache.py``), L >= P + N. Every ``refill_every`` steps, each empty slot takes
the next waiting request, in request order: the slot's entries ``[0, P)`` get the group's
prompt keys and values, its next-token logits the group's, its length the prompt's. A decode
step then, for every slot holding a request:

1. draws token t of request r with the key :func:`sampling.token_key` ``(key, r, t)``;
2. records it (tokens / log-probs ``[R, N]``) and stops the request at eos, at a stop string
   (``stop.py``), or at its own limit ``max_tokens[r]`` (then ``truncated[r]``);
3. runs the model on the token at entry ``length`` of its slot (one query per slot; attention
   covers the slot's own entries, in blocks up to the longest live slot).

A stopped slot is empty until the next refill. The loop ends when every request has stopped.

Invariance. What request r generates depends on the key, r, its prompt, its limit and the
weights only: its random bits are a function of (key, r, t), and its logits of its own tokens
(a slot attends to its own entries only, and stale entries of earlier requests lie beyond its
length). So the same key gives the same completions for any slot count, refill interval, batch
padding or mesh, up to float reduction order in the matmuls.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh

from jaxrl.generate.sampling import sample_tokens, token_key
from jaxrl.generate.stop import MATCHED
from jaxrl.models.kv_cache import KVCache
from jaxrl.models.slot_kv_cache import SlotKVCache
from jaxrl.models.transformer import Transformer
from jaxrl.runtime.spmd import constrain_rows

__all__ = ["EngineShape", "decode_requests", "prefill_prompts"]


@dataclasses.dataclass(frozen=True)
class EngineShape:
    """The static part of an engine program (one compiled program per distinct value)."""

    slots: int  # S decode slots
    max_new_tokens: int  # N: the longest completion, the width of the outputs
    cache_length: int  # L >= P + N, a multiple of ``block``
    block: int  # entries per decode-attention block
    refill_every: int  # k: empty slots take waiting requests every k decode steps
    prefill_chunk: int  # C: prefill this many prompt tokens at a time; 0 = all P at once
    pad_id: int  # written after a request's last token
    eos_ids: tuple[int, ...]  # E stop token ids


def prefill_prompts(
    model: Transformer, tokens_QP: jax.Array, lengths_Q: jax.Array, chunk: int
) -> tuple[jax.Array, KVCache]:
    """Right-padded prompts into a fresh cache of P entries: ``(next-token logits [Q, V],
    cache)``. With ``chunk`` (P a multiple of it), C tokens at a time: each chunk's queries
    attend to the cache filled so far (prefix chunks) and themselves."""
    q, p = tokens_QP.shape
    idx_1P = jnp.arange(p, dtype=jnp.int32)[None, :]
    segment_ids_QP = (idx_1P < lengths_Q[:, None]).astype(jnp.int32)
    positions_QP = jnp.broadcast_to(idx_1P, (q, p))
    last_Q = jnp.maximum(lengths_Q - 1, 0)
    cache = KVCache.empty(model.config, q, p)
    if not chunk or chunk >= p:
        hidden_QPD, cache = model.decode(tokens_QP, positions_QP, segment_ids_QP, cache)
        last_QD = jnp.take_along_axis(hidden_QPD, last_Q[:, None, None], axis=1)[:, 0]
    else:

        def one_chunk(carry, c):
            cache, last_QD = carry
            cut = lambda x: lax.dynamic_slice_in_dim(x, c * chunk, chunk, axis=1)  # noqa: E731
            hidden_QCD, cache = model.decode(
                cut(tokens_QP), cut(positions_QP), cut(segment_ids_QP), cache
            )
            here_Q = (last_Q >= c * chunk) & (last_Q < (c + 1) * chunk)
            at_Q = jnp.clip(last_Q - c * chunk, 0, chunk - 1)
            pick_QD = jnp.take_along_axis(hidden_QCD, at_Q[:, None, None], axis=1)[:, 0]
            return (cache, jnp.where(here_Q[:, None], pick_QD, last_QD)), None

        zeros_QD = jnp.zeros((q, model.config.hidden_size), model.config.dtype)
        (cache, last_QD), _ = lax.scan(one_chunk, (cache, zeros_QD), jnp.arange(p // chunk))
    return model.logits(last_QD[:, None])[:, 0], cache


def decode_requests(
    model: Transformer,
    shape: EngineShape,
    *,
    prompts_QP: jax.Array,
    prompt_lengths_Q: jax.Array,
    group_R: jax.Array,
    max_tokens_R: jax.Array,
    num_requests: jax.Array,
    key: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    stop_ZV: jax.Array | None,
    mesh: Mesh | None = None,
) -> tuple[jax.Array, ...]:
    """Generate every request (module doc): ``(tokens [R, N], logprobs [R, N], lengths [R],
    truncated [R], decode steps)``. Requests ``>= num_requests`` are padding, never run."""
    s, n, r = shape.slots, shape.max_new_tokens, group_R.shape[0]
    prompt_logits_QV, prompt_cache = prefill_prompts(
        model, prompts_QP, prompt_lengths_Q, shape.prefill_chunk
    )
    eos_E = jnp.asarray(shape.eos_ids, jnp.int32)
    cache = SlotKVCache.empty(model.config, s, shape.cache_length, shape.block)
    cache = dataclasses.replace(
        cache,
        keys=constrain_rows(cache.keys, mesh, axis=1),
        values=constrain_rows(cache.values, mesh, axis=1),
    )
    rows = lambda x: constrain_rows(x, mesh)  # noqa: E731  # slot arrays: split like the cache

    def refill(carry):
        cache, logits_SV, req_S, pos_S, t_S, state_S, next_req = carry
        free_S = req_S < 0
        cand_S = next_req + jnp.cumsum(free_S.astype(jnp.int32)) - 1
        take_S = free_S & (cand_S < num_requests)
        g_S = jnp.take(group_R, cand_S, mode="clip")
        cache = cache.fill_prompts(prompt_cache.keys, prompt_cache.values, g_S, take_S)
        logits_SV = jnp.where(take_S[:, None], prompt_logits_QV[g_S], logits_SV)
        return (
            cache,
            logits_SV,
            jnp.where(take_S, cand_S, req_S),
            jnp.where(take_S, prompt_lengths_Q[g_S], pos_S),
            jnp.where(take_S, 0, t_S),
            jnp.where(take_S, 0, state_S),
            next_req + jnp.sum(take_S.astype(jnp.int32)),
        )

    def cond(carry):
        req_S, next_req = carry[3], carry[7]
        return (next_req < num_requests) | jnp.any(req_S >= 0)

    def body(carry):
        step, cache, logits_SV, req_S, pos_S, t_S, state_S, next_req, out = carry
        tokens_RN, logprobs_RN, lengths_R, truncated_R = out
        slot = (cache, logits_SV, req_S, pos_S, t_S, state_S, next_req)
        due = (step % shape.refill_every == 0) & jnp.any(req_S < 0) & (next_req < num_requests)
        cache, logits_SV, req_S, pos_S, t_S, state_S, next_req = lax.cond(
            due, refill, lambda c: c, slot
        )
        active_S = req_S >= 0
        r_S = jnp.maximum(req_S, 0)
        keys_S = jax.vmap(token_key, in_axes=(None, 0, 0))(key, r_S, t_S)
        tok_S, logp_S = sample_tokens(keys_S, logits_SV, temperature, top_k, top_p)
        write_S = jnp.where(active_S, req_S, r)  # row r is out of bounds: dropped
        tokens_RN = tokens_RN.at[write_S, t_S].set(tok_S, mode="drop")
        logprobs_RN = logprobs_RN.at[write_S, t_S].set(logp_S, mode="drop")
        t_S = t_S + 1
        eos_S = jnp.any(tok_S[:, None] == eos_E[None, :], axis=-1)
        if stop_ZV is not None:
            next_state_S = stop_ZV[state_S, tok_S]
            eos_S = eos_S | (next_state_S == MATCHED)
            state_S = jnp.maximum(next_state_S, 0)
        limit_S = t_S >= jnp.take(max_tokens_R, r_S)
        finished_S = active_S & (eos_S | limit_S)
        end_S = jnp.where(finished_S, req_S, r)
        lengths_R = lengths_R.at[end_S].set(t_S, mode="drop")
        truncated_R = truncated_R.at[end_S].set(~eos_S, mode="drop")
        live_S = active_S & ~finished_S
        feed_S = jnp.where(live_S, pos_S, 0)  # idle slots write entry 0, refilled before use
        hidden_S1D, cache = model.decode(
            tok_S[:, None], feed_S[:, None], jnp.ones((s, 1), jnp.int32), cache
        )
        logits_SV = rows(model.logits(hidden_S1D)[:, 0])
        out = (tokens_RN, logprobs_RN, lengths_R, truncated_R)
        return (
            step + 1,
            cache,
            logits_SV,
            jnp.where(finished_S, -1, req_S),
            jnp.where(live_S, pos_S + 1, pos_S),
            t_S,
            state_S,
            next_req,
            out,
        )

    v = prompt_logits_QV.shape[-1]
    zeros_S = rows(jnp.zeros((s,), jnp.int32))
    carry = (
        jnp.zeros((), jnp.int32),
        cache,
        rows(jnp.zeros((s, v), prompt_logits_QV.dtype)),
        zeros_S - 1,  # every slot empty
        zeros_S,
        zeros_S,
        zeros_S,
        jnp.zeros((), jnp.int32),
        (
            jnp.full((r, n), shape.pad_id, jnp.int32),
            jnp.zeros((r, n), jnp.float32),
            jnp.zeros((r,), jnp.int32),
            jnp.zeros((r,), bool),
        ),
    )
    steps, *_, (tokens_RN, logprobs_RN, lengths_R, truncated_R) = lax.while_loop(cond, body, carry)
    return tokens_RN, logprobs_RN, lengths_R, truncated_R, steps
