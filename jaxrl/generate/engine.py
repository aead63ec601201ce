"""Continuous batching: one compiled program that prefills prompt groups and decodes requests in
a fixed number of slots, refilling a slot as soon as its request stops.

Requests and groups. A call holds Rq requests (completions to generate) over Q distinct prompts
(groups): request r continues prompt ``group[r]``. The Q prompts are prefilled once each, right
padded to P tokens (chunks of C tokens when ``prefill_chunk`` is set), into a prompt cache
``[Nl, Q, P, K, Dh]`` (``kv_cache.KVCache``) together with each prompt's next-token logits; the
G completions of a prompt share that one prefill.

Slots. Sl decode slots share a slot-contiguous cache ``[Nl, Sl, L, K, Dh]``
(``models/slot_kv_cache.py``), L >= P + N. Every ``refill_every`` steps, each empty slot takes
the next waiting request, in request order: the slot's entries ``[0, P)`` get the group's
prompt keys and values, its next-token logits the group's, its length the prompt's. A decode
step then, for every slot holding a request:

1. draws token t of request r with the key :func:`sampling.token_key` ``(key, r, t)``;
2. records it (tokens / log-probs ``[Rq, N]``) and stops the request at eos, at a stop string
   (``stop.py``), or at its own limit ``max_tokens[r]`` (then ``truncated[r]``);
3. runs the model on the token at entry ``length`` of its slot (one query per slot; attention
   covers the slot's own entries, in blocks up to the longest live slot).

A stopped slot is empty until the next refill. The loop ends when every request has stopped.

MoE routes (``record_routes``, router replay: docs/moe.md): the prefill and every decode step
also return the expert ids each MoE layer chose for the tokens they ran
(``Transformer.routed_decode``), kept as prompt routes ``[Q, P, Lm, K]`` and completion routes
``[Rq, N, Lm, K]`` (entry t: completion token t, fed at the step after it was drawn; a
request's last token is never fed, so its entry stays -1).

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

__all__ = ["DecodeState", "EngineShape", "decode_requests", "prefill_prompts"]


@dataclasses.dataclass(frozen=True)
class EngineShape:
    """The static part of an engine program (one compiled program per distinct value)."""

    slots: int  # Sl decode slots
    max_new_tokens: int  # N: the longest completion, the width of the outputs
    cache_length: int  # L >= P + N, a multiple of ``block``
    block: int  # entries per decode-attention block
    refill_every: int  # k: empty slots take waiting requests every k decode steps
    prefill_chunk: int  # C: prefill this many prompt tokens at a time; 0 = all P at once
    pad_id: int  # written after a request's last token
    eos_ids: tuple[int, ...]  # E stop token ids


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """The decode loop's state (the ``lax.while_loop`` carry): the slots, then the outputs."""

    step: jax.Array  # int32 scalar: decode steps run
    cache: SlotKVCache  # [Nl, Sl, L, K, Dh] keys and values
    logits_SlV: jax.Array  # next-token logits of each slot
    request_Sl: jax.Array  # int32: the request a slot holds; -1 = empty
    position_Sl: jax.Array  # int32: the cache entry the slot's next token is written to
    emitted_Sl: jax.Array  # int32: tokens the slot's request has generated (t)
    stop_state_Sl: jax.Array  # int32: the slot's state in the stop-string automaton
    next_request: jax.Array  # int32 scalar: the first request no slot has taken yet
    tokens_RqN: jax.Array  # int32: generated tokens, pad_id after the end
    logprobs_RqN: jax.Array  # float32: their sampler log-probs, 0 after the end
    lengths_Rq: jax.Array  # int32: tokens generated, set when a request stops
    truncated_Rq: jax.Array  # bool: stopped at its limit, without eos or stop string
    routes_RqNLK: jax.Array | None = None  # int32 MoE routes of the fed tokens (-1 = none)


def prefill_prompts(
    model: Transformer,
    tokens_QP: jax.Array,
    lengths_Q: jax.Array,
    chunk: int,
    record_routes: bool = False,
) -> tuple[jax.Array, ...]:
    """Right-padded prompts into a fresh cache of P entries: ``(next-token logits [Q, V],
    cache)``, with ``record_routes`` also the MoE routes ``[Q, P, Lm, K]``. With ``chunk`` (P a
    multiple of it), C tokens at a time: each chunk's queries attend to the cache filled so
    far (prefix chunks) and themselves."""
    q, p = tokens_QP.shape
    idx_1P = jnp.arange(p, dtype=jnp.int32)[None, :]
    segment_ids_QP = (idx_1P < lengths_Q[:, None]).astype(jnp.int32)
    positions_QP = jnp.broadcast_to(idx_1P, (q, p))
    last_Q = jnp.maximum(lengths_Q - 1, 0)
    cache = KVCache.empty(model.config, q, p)

    def run(tokens, positions, segments, cache):  # (hidden, cache, routes or None)
        if record_routes:
            return model.routed_decode(tokens, positions, segments, cache)
        return (*model.decode(tokens, positions, segments, cache), None)

    if not chunk or chunk >= p:
        hidden_QPD, cache, routes = run(tokens_QP, positions_QP, segment_ids_QP, cache)
        last_QD = jnp.take_along_axis(hidden_QPD, last_Q[:, None, None], axis=1)[:, 0]
    else:

        def one_chunk(carry, c):
            cache, last_QD = carry
            cut = lambda x: lax.dynamic_slice_in_dim(x, c * chunk, chunk, axis=1)  # noqa: E731
            hidden_QCD, cache, routes_QCLK = run(
                cut(tokens_QP), cut(positions_QP), cut(segment_ids_QP), cache
            )
            here_Q = (last_Q >= c * chunk) & (last_Q < (c + 1) * chunk)
            at_Q = jnp.clip(last_Q - c * chunk, 0, chunk - 1)
            pick_QD = jnp.take_along_axis(hidden_QCD, at_Q[:, None, None], axis=1)[:, 0]
            return (cache, jnp.where(here_Q[:, None], pick_QD, last_QD)), routes_QCLK

        zeros_QD = jnp.zeros((q, model.config.hidden_size), model.config.dtype)
        (cache, last_QD), routes = lax.scan(one_chunk, (cache, zeros_QD), jnp.arange(p // chunk))
        if record_routes:  # [Nc, Q, C, Lm, K] -> [Q, P, Lm, K]
            routes = jnp.moveaxis(routes, 0, 1).reshape(q, p, *routes.shape[3:])
    logits_QV = model.logits(last_QD[:, None])[:, 0]
    return (logits_QV, cache, routes) if record_routes else (logits_QV, cache)


def decode_requests(
    model: Transformer,
    shape: EngineShape,
    *,
    prompts_QP: jax.Array,
    prompt_lengths_Q: jax.Array,
    group_Rq: jax.Array,
    max_tokens_Rq: jax.Array,
    num_requests: jax.Array,
    key: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    stop_ZV: jax.Array | None,
    mesh: Mesh | None = None,
    record_routes: bool = False,
) -> tuple[jax.Array, ...]:
    """Generate every request (module doc): ``(tokens [Rq, N], logprobs [Rq, N], lengths [Rq],
    truncated [Rq], decode steps)``, with ``record_routes`` (a MoE model) also the prompt
    routes ``[Q, P, Lm, K]`` and completion routes ``[Rq, N, Lm, K]``. Requests
    ``>= num_requests`` are padding, never run."""
    s, n, r = shape.slots, shape.max_new_tokens, group_Rq.shape[0]
    prompt_logits_QV, prompt_cache, *prompt_routes = prefill_prompts(
        model, prompts_QP, prompt_lengths_Q, shape.prefill_chunk, record_routes
    )
    eos_E = jnp.asarray(shape.eos_ids, jnp.int32)
    cache = SlotKVCache.empty(model.config, s, shape.cache_length, shape.block)
    cache = dataclasses.replace(
        cache,
        # [Nl, Sl, L, K, Dh]: slots over the batch axes, KV heads over tensor (decode_layout.py)
        keys=constrain_rows(cache.keys, mesh, axis=1, tensor_axis=3),
        values=constrain_rows(cache.values, mesh, axis=1, tensor_axis=3),
    )
    rows = lambda x: constrain_rows(x, mesh)  # noqa: E731  # slot arrays: split like the cache

    def refill(state: DecodeState) -> DecodeState:
        free_Sl = state.request_Sl < 0
        cand_Sl = state.next_request + jnp.cumsum(free_Sl.astype(jnp.int32)) - 1
        take_Sl = free_Sl & (cand_Sl < num_requests)
        g_Sl = jnp.take(group_Rq, cand_Sl, mode="clip")
        cache = state.cache.fill_prompts(prompt_cache.keys, prompt_cache.values, g_Sl, take_Sl)
        return dataclasses.replace(
            state,
            cache=cache,
            logits_SlV=jnp.where(take_Sl[:, None], prompt_logits_QV[g_Sl], state.logits_SlV),
            request_Sl=jnp.where(take_Sl, cand_Sl, state.request_Sl),
            position_Sl=jnp.where(take_Sl, prompt_lengths_Q[g_Sl], state.position_Sl),
            emitted_Sl=jnp.where(take_Sl, 0, state.emitted_Sl),
            stop_state_Sl=jnp.where(take_Sl, 0, state.stop_state_Sl),
            next_request=state.next_request + jnp.sum(take_Sl.astype(jnp.int32)),
        )

    def cond(state: DecodeState) -> jax.Array:
        return (state.next_request < num_requests) | jnp.any(state.request_Sl >= 0)

    def body(state: DecodeState) -> DecodeState:
        due = (
            (state.step % shape.refill_every == 0)
            & jnp.any(state.request_Sl < 0)
            & (state.next_request < num_requests)
        )
        state = lax.cond(due, refill, lambda st: st, state)
        req_Sl, t_Sl, stop_state_Sl = state.request_Sl, state.emitted_Sl, state.stop_state_Sl
        active_Sl = req_Sl >= 0
        r_Sl = jnp.maximum(req_Sl, 0)
        keys_Sl = jax.vmap(token_key, in_axes=(None, 0, 0))(key, r_Sl, t_Sl)
        tok_Sl, logp_Sl = sample_tokens(keys_Sl, state.logits_SlV, temperature, top_k, top_p)
        write_Sl = jnp.where(active_Sl, req_Sl, r)  # request r is out of bounds: dropped
        tokens_RqN = state.tokens_RqN.at[write_Sl, t_Sl].set(tok_Sl, mode="drop")
        logprobs_RqN = state.logprobs_RqN.at[write_Sl, t_Sl].set(logp_Sl, mode="drop")
        t_Sl = t_Sl + 1
        eos_Sl = jnp.any(tok_Sl[:, None] == eos_E[None, :], axis=-1)
        if stop_ZV is not None:
            next_state_Sl = stop_ZV[stop_state_Sl, tok_Sl]
            eos_Sl = eos_Sl | (next_state_Sl == MATCHED)
            stop_state_Sl = jnp.maximum(next_state_Sl, 0)
        limit_Sl = t_Sl >= jnp.take(max_tokens_Rq, r_Sl)
        finished_Sl = active_Sl & (eos_Sl | limit_Sl)
        end_Sl = jnp.where(finished_Sl, req_Sl, r)
        lengths_Rq = state.lengths_Rq.at[end_Sl].set(t_Sl, mode="drop")
        truncated_Rq = state.truncated_Rq.at[end_Sl].set(~eos_Sl, mode="drop")
        live_Sl = active_Sl & ~finished_Sl
        feed_Sl = jnp.where(live_Sl, state.position_Sl, 0)  # idle: entry 0, refilled before use
        feed = (tok_Sl[:, None], feed_Sl[:, None], jnp.ones((s, 1), jnp.int32), state.cache)
        routes_RqNLK = state.routes_RqNLK
        if record_routes:
            hidden_Sl1D, cache, routes_Sl1LK = model.routed_decode(*feed)
            fed_Sl = jnp.where(live_Sl, req_Sl, r)  # the token drawn at t - 1, fed now
            routes_RqNLK = routes_RqNLK.at[fed_Sl, t_Sl - 1].set(routes_Sl1LK[:, 0], mode="drop")
        else:
            hidden_Sl1D, cache = model.decode(*feed)
        return DecodeState(
            step=state.step + 1,
            cache=cache,
            logits_SlV=rows(model.logits(hidden_Sl1D)[:, 0]),
            request_Sl=jnp.where(finished_Sl, -1, req_Sl),
            position_Sl=jnp.where(live_Sl, state.position_Sl + 1, state.position_Sl),
            emitted_Sl=t_Sl,
            stop_state_Sl=stop_state_Sl,
            next_request=state.next_request,
            tokens_RqN=tokens_RqN,
            logprobs_RqN=logprobs_RqN,
            lengths_Rq=lengths_Rq,
            truncated_Rq=truncated_Rq,
            routes_RqNLK=routes_RqNLK,
        )

    v = prompt_logits_QV.shape[-1]
    zeros_Sl = rows(jnp.zeros((s,), jnp.int32))
    state = DecodeState(
        step=jnp.zeros((), jnp.int32),
        cache=cache,
        logits_SlV=rows(jnp.zeros((s, v), prompt_logits_QV.dtype)),
        request_Sl=zeros_Sl - 1,  # every slot empty
        position_Sl=zeros_Sl,
        emitted_Sl=zeros_Sl,
        stop_state_Sl=zeros_Sl,
        next_request=jnp.zeros((), jnp.int32),
        tokens_RqN=jnp.full((r, n), shape.pad_id, jnp.int32),
        logprobs_RqN=jnp.zeros((r, n), jnp.float32),
        lengths_Rq=jnp.zeros((r,), jnp.int32),
        truncated_Rq=jnp.zeros((r,), bool),
    )
    if record_routes:
        lm, k = len(model.config.moe_layers), model.config.num_experts_per_tok
        state = dataclasses.replace(state, routes_RqNLK=jnp.full((r, n, lm, k), -1, jnp.int32))
    out = lax.while_loop(cond, body, state)
    outs = out.tokens_RqN, out.logprobs_RqN, out.lengths_Rq, out.truncated_Rq, out.step
    return (*outs, prompt_routes[0], out.routes_RqNLK) if record_routes else outs
