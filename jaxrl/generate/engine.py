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

Compaction (``EngineShape.compact``, smaller slot counts, ascending). A step costs its Sl
rows in every matmul, the LM head and the draw, live or not, so once few requests are left (the
long tail of completion lengths; most of them when every request was admitted at once) a step
over all slots mostly computes for empty ones. With ``compact``, the loop above runs while
requests wait or more slots are live than the largest of them; then the live slots (and empty
ones up to that size) are gathered, their cache rows with them, into a state of that many
slots, and the loop goes on there (no refill: every request is admitted), down to the next
size, and so on. Each size is a loop of its own in the program (one more step body to
compile); the gathers run once per size, not per step. Nothing a request generates depends
on it beyond float reduction order in the matmuls (the random bits are per (request, token)).

MoE routes (``record_routes``, router replay: docs/moe.md): the prefill and every decode step
also return the expert ids each MoE layer chose for the tokens they ran
(``Transformer.routed_decode``), kept as prompt routes ``[Q, P, Lm, K]`` and completion routes
``[Rq, N, Lm, K]`` (entry t: completion token t, recorded when the slot runs it; a request's
last token is recorded as -1, since no later token reads it).

Invariance. What request r generates depends on the key, r, its prompt, its limit and the
weights only: its random bits are a function of (key, r, t), and its logits of its own tokens
(a slot attends to its own entries only, and stale entries of earlier requests lie beyond its
length). So the same key gives the same completions for any slot count, refill interval, batch
padding or mesh, up to float reduction order in the matmuls.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

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

__all__ = [
    "DecodeState",
    "EngineResult",
    "EngineShape",
    "Prefill",
    "continue_slots",
    "decode_requests",
    "prefill_prompts",
    "prefill_rows",
]


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
    prompt_length: int = 0  # P: entries a refill copies from the prompt cache (0: its width)
    compact: tuple[int, ...] = ()  # smaller slot counts, ascending: the loop moves the live
    # slots into them as requests stop (module doc, "Compaction"); () = all Sl slots throughout


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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EngineResult:
    """What an engine program returns (:func:`decode_requests`, :func:`continue_slots`): one
    row per request (a session's turn: per slot)."""

    tokens_RqN: jax.Array  # int32: generated tokens, pad_id after the end
    logprobs_RqN: jax.Array  # float32: their sampler log-probs, 0 after the end
    lengths_Rq: jax.Array  # int32: tokens generated (eos / stop token included)
    truncated_Rq: jax.Array  # bool: stopped at its limit, without eos or stop string
    steps: jax.Array  # int32 scalar: decode steps run
    compacted_steps: jax.Array  # int32 scalar: of those, steps run compacted (module doc)
    prompt_routes: jax.Array | None = None  # MoE (``record_routes``): the routes of what was
    # prefilled: decode_requests' prompts [Q, P, Lm, K], continue_slots' new tokens [Sl, E, Lm, K]
    routes_RqNLK: jax.Array | None = None  # MoE: the completions' routes (-1 = none)
    cache: SlotKVCache | None = None  # continue_slots: the slots' cache after the turn


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Prefill:
    """A prefill's results (:func:`prefill_rows`)."""

    logits_QV: jax.Array  # next-token logits of each prompt's last token
    cache: KVCache  # the prompts' keys and values, W entries per row
    routes: jax.Array | None = None  # MoE (``record_routes``): every entry's, [R * W, Lm, K]


def _run(model: Transformer, record_routes: bool, *args: jax.Array, loop: bool = False) -> tuple:
    """``model.decode(*args)`` as ``(hidden, cache, routes or None)``; MoE routes with
    ``record_routes`` (``Transformer.routed_decode``); ``loop``: ``loop_layers``."""
    if record_routes:
        return model.routed_decode(*args, loop_layers=loop)
    return (*model.decode(*args, loop_layers=loop), None)


def _prefill(model: Transformer, record_routes: bool, *args: jax.Array) -> tuple:
    """:func:`_run` for a prefill. In a float32 compute dtype, unrolled layers run in a loop
    holding the block once (``loop_layers``): a prefill is one pass, so the copy of each layer's
    weights it costs is small against its matmuls, and it compiles like the scanned layout, not
    like Nl blocks (SmolLM2-135M: 0.85 s against 3.4 s; the engine's first call 9-10 s against
    13 s on 2 CPU cores). In a narrower compute dtype the prefill stays unrolled: XLA keeps
    excess precision between fused ops, so where values are rounded depends on the program's
    structure, and the loop would round the prompt's keys where the trainer's forward does not
    (log-probs 1e-2 apart in bf16)."""
    loop = jnp.dtype(model.config.dtype) == jnp.float32
    return _run(model, record_routes, *args, loop=loop)


def prefill_rows(
    model: Transformer,
    tokens_RW: jax.Array,
    segment_ids_RW: jax.Array,
    positions_RW: jax.Array,
    last_Q: jax.Array,
    chunk: int,
    record_routes: bool = False,
) -> Prefill:
    """Prompts packed into R rows of W tokens (``segment_ids`` 1.. per prompt, 0 = padding;
    ``positions`` from 0 in each prompt) into a fresh cache of W entries per row: the
    next-token logits ``[Q, V]`` and the cache. ``last_Q`` is the flat entry
    ``row * W + column`` of prompt q's last token. A prompt attends to its own tokens only
    (``kv_cache.py``), so its keys, values and logits are those of a prefill of the prompt
    alone, up to float reduction order. With ``chunk`` (W a multiple of it), C tokens at a time:
    each chunk's queries attend to the cache filled so far (prefix chunks) and themselves. With
    ``record_routes`` (a MoE model) also the routes of every entry, ``[R * W, Lm, K]``."""
    r, w = tokens_RW.shape
    cache = KVCache.empty(model.config, r, w)
    if not chunk or chunk >= w:
        hidden_RWD, cache, routes = _prefill(
            model, record_routes, tokens_RW, positions_RW, segment_ids_RW, cache
        )
        hidden_ND = hidden_RWD.reshape(r * w, -1)
    else:

        def one_chunk(cache, c):
            cut = lambda x: lax.dynamic_slice_in_dim(x, c * chunk, chunk, axis=1)  # noqa: E731
            hidden_RCD, cache, routes_RCLK = _prefill(
                model, record_routes, cut(tokens_RW), cut(positions_RW), cut(segment_ids_RW), cache
            )
            return cache, (hidden_RCD, routes_RCLK)

        cache, (hidden_cRCD, routes) = lax.scan(one_chunk, cache, jnp.arange(w // chunk))
        hidden_ND = jnp.moveaxis(hidden_cRCD, 0, 1).reshape(r * w, -1)  # [R, c, C, D] -> [R*W, D]
        if record_routes:  # [c, R, C, Lm, K] -> [R, W, Lm, K]
            routes = jnp.moveaxis(routes, 0, 1).reshape(r, w, *routes.shape[3:])
    last_QD = jnp.take(hidden_ND, last_Q, axis=0, mode="clip")
    logits_QV = model.logits(last_QD[:, None])[:, 0]
    if record_routes:
        routes = routes.reshape(r * w, *routes.shape[2:])
    return Prefill(logits_QV=logits_QV, cache=cache, routes=routes)


def prefill_prompts(
    model: Transformer,
    tokens_QP: jax.Array,
    lengths_Q: jax.Array,
    chunk: int,
    record_routes: bool = False,
) -> Prefill:
    """Right-padded prompts, one per row, into a fresh cache of P entries (:func:`prefill_rows`
    with prompt q alone in row q); MoE routes ``[Q * P, Lm, K]`` with ``record_routes``."""
    q, p = tokens_QP.shape
    idx_1P = jnp.arange(p, dtype=jnp.int32)[None, :]
    segment_ids_QP = (idx_1P < lengths_Q[:, None]).astype(jnp.int32)
    positions_QP = jnp.broadcast_to(idx_1P, (q, p))
    last_Q = jnp.arange(q, dtype=jnp.int32) * p + jnp.maximum(lengths_Q - 1, 0)
    return prefill_rows(
        model, tokens_QP, segment_ids_QP, positions_QP, last_Q, chunk, record_routes
    )


def _decode_step(
    model: Transformer,
    shape: EngineShape,
    state: DecodeState,
    key_Sl: Callable[[jax.Array, jax.Array], jax.Array],
    max_tokens_Rq: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    stop_ZV: jax.Array | None,
    rows: Callable[[jax.Array], jax.Array],
    keep_idle: bool = False,
    record_routes: bool = False,
    record_last: bool = False,
) -> DecodeState:
    """One decode step of every slot (module doc, steps 1-3). ``key_Sl(r_Sl, t_Sl)``: the keys
    of token t of request r. A slot whose request stops runs its last token too, so its cache
    holds the whole sequence (a session continues it). An empty slot writes a throwaway entry:
    at entry 0 (it will be refilled, and its attention then spans one block), or with
    ``keep_idle`` (a session's slot sitting the turn out) at its position, past everything it
    holds. ``record_routes``: write the MoE routes of the tokens run for live requests (with
    ``record_last`` a stopping request's last token's too: a session's next turn follows it)."""
    s, r = state.request_Sl.shape[0], state.tokens_RqN.shape[0]
    eos_E = jnp.asarray(shape.eos_ids, jnp.int32)
    req_Sl, t_Sl, stop_state_Sl = state.request_Sl, state.emitted_Sl, state.stop_state_Sl
    active_Sl = req_Sl >= 0
    r_Sl = jnp.maximum(req_Sl, 0)
    tok_Sl, logp_Sl = sample_tokens(key_Sl(r_Sl, t_Sl), state.logits_SlV, temperature, top_k, top_p)
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
    feed_Sl = jnp.minimum(state.position_Sl, state.cache.length - 1)
    if not keep_idle:
        feed_Sl = jnp.where(active_Sl, feed_Sl, 0)
    hidden_Sl1D, cache, routes_Sl1LK = _run(
        model,
        record_routes,
        tok_Sl[:, None],
        feed_Sl[:, None],
        jnp.ones((s, 1), jnp.int32),
        state.cache,
    )
    routes_RqNLK = state.routes_RqNLK
    if record_routes:  # token t - 1 of each live request ran now; a last token stays -1
        kept_Sl = active_Sl if record_last else active_Sl & ~finished_Sl
        fed_Sl = jnp.where(kept_Sl, req_Sl, r)
        routes_RqNLK = routes_RqNLK.at[fed_Sl, t_Sl - 1].set(routes_Sl1LK[:, 0], mode="drop")
    return DecodeState(
        step=state.step + 1,
        cache=cache,
        logits_SlV=rows(model.logits(hidden_Sl1D)[:, 0]),
        request_Sl=jnp.where(finished_Sl, -1, req_Sl),
        position_Sl=jnp.where(active_Sl, state.position_Sl + 1, state.position_Sl),
        emitted_Sl=t_Sl,
        stop_state_Sl=stop_state_Sl,
        next_request=state.next_request,
        tokens_RqN=tokens_RqN,
        logprobs_RqN=logprobs_RqN,
        lengths_Rq=lengths_Rq,
        truncated_Rq=truncated_Rq,
        routes_RqNLK=routes_RqNLK,
    )


def _compacted(state: DecodeState, size: int, rows: Callable) -> DecodeState:
    """The state in ``size`` of its Sl slots (module doc, "Compaction"): the live ones (at most
    ``size``), then empty ones, each in slot order, with their cache rows."""
    slots_n = jnp.argsort(state.request_Sl < 0, stable=True)[:size].astype(jnp.int32)
    take = lambda x, axis=0: jnp.take(x, slots_n, axis=axis)  # noqa: E731
    cache = dataclasses.replace(
        state.cache, keys=take(state.cache.keys, 1), values=take(state.cache.values, 1)
    )
    fields = ("logits_SlV", "request_Sl", "position_Sl", "emitted_Sl", "stop_state_Sl")
    return dataclasses.replace(
        state, cache=cache, **{f: rows(take(getattr(state, f))) for f in fields}
    )


def _initial_state(
    shape: EngineShape,
    r: int,
    logits_SlV: jax.Array,
    cache: SlotKVCache,
    rows: Callable,
    routes_LK: tuple[int, int] | None = None,
) -> DecodeState:
    """The loop's first state: every slot empty, no request generated yet; with ``routes_LK``
    (MoE layers, experts per token) room for the completions' routes, all -1."""
    routes = None
    if routes_LK is not None:
        routes = jnp.full((r, shape.max_new_tokens, *routes_LK), -1, jnp.int32)
    zeros_Sl = rows(jnp.zeros((logits_SlV.shape[0],), jnp.int32))
    return DecodeState(
        step=jnp.zeros((), jnp.int32),
        cache=cache,
        logits_SlV=rows(logits_SlV),
        request_Sl=zeros_Sl - 1,  # every slot empty
        position_Sl=zeros_Sl,
        emitted_Sl=zeros_Sl,
        stop_state_Sl=zeros_Sl,
        next_request=jnp.zeros((), jnp.int32),
        tokens_RqN=jnp.full((r, shape.max_new_tokens), shape.pad_id, jnp.int32),
        logprobs_RqN=jnp.zeros((r, shape.max_new_tokens), jnp.float32),
        lengths_Rq=jnp.zeros((r,), jnp.int32),
        truncated_Rq=jnp.zeros((r,), bool),
        routes_RqNLK=routes,
    )


def decode_requests(
    model: Transformer,
    shape: EngineShape,
    *,
    prompts_RW: jax.Array,
    segment_ids_RW: jax.Array,
    positions_RW: jax.Array,
    start_Q: jax.Array,
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
) -> EngineResult:
    """Generate every request (module doc): tokens and log-probs ``[Rq, N]``, lengths and
    truncation ``[Rq]``, the decode steps run and how many of them ran compacted; with
    ``record_routes`` (a MoE model) also the prompt routes ``[Q, P, Lm, K]`` and completion
    routes ``[Rq, N, Lm, K]``. Requests ``>= num_requests`` are padding, never run. The Q
    prompts come packed in rows (:func:`prefill_rows`); prompt q starts at the flat entry
    ``start_Q[q]`` (``row * W + column``)."""
    s, r = shape.slots, group_Rq.shape[0]
    last_Q = start_Q + jnp.maximum(prompt_lengths_Q - 1, 0)
    prefill = prefill_rows(
        model, prompts_RW, segment_ids_RW, positions_RW, last_Q, shape.prefill_chunk,
        record_routes,
    )  # fmt: skip
    prompt_logits_QV, prompt_cache = prefill.logits_QV, prefill.cache
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
        cache = state.cache.fill_prompts(
            prompt_cache.keys, prompt_cache.values, start_Q[g_Sl], take_Sl, shape.prompt_length
        )
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

    live = lambda state: jnp.sum((state.request_Sl >= 0).astype(jnp.int32))  # noqa: E731
    sizes = (0, *shape.compact)  # each phase runs while more slots are live than the next size

    def cond(state: DecodeState) -> jax.Array:
        return (state.next_request < num_requests) | (live(state) > sizes[-1])

    request_key = lambda r_Sl, t_Sl: jax.vmap(token_key, in_axes=(None, 0, 0))(key, r_Sl, t_Sl)  # noqa: E731

    def step(state: DecodeState) -> DecodeState:
        return _decode_step(
            model, shape, state, request_key, max_tokens_Rq, temperature, top_k, top_p,
            stop_ZV, rows, record_routes=record_routes,
        )  # fmt: skip

    def body(state: DecodeState) -> DecodeState:
        due = (
            (state.step % shape.refill_every == 0)
            & jnp.any(state.request_Sl < 0)
            & (state.next_request < num_requests)
        )
        return step(lax.cond(due, refill, lambda st: st, state))

    v = prompt_logits_QV.shape[-1]
    routes_LK = None
    if record_routes:
        routes_LK = (len(model.config.moe_layers), model.config.num_experts_per_tok)
    logits_SlV = jnp.zeros((s, v), prompt_logits_QV.dtype)
    state = _initial_state(shape, r, logits_SlV, cache, rows, routes_LK)
    out = uncompacted = lax.while_loop(cond, body, state)
    for size, below in zip(sizes[:0:-1], sizes[-2::-1], strict=True):  # compaction phases
        out = _compacted(out, size, rows)  # every request admitted: no refill from here on
        out = lax.while_loop(lambda st, below=below: live(st) > below, step, out)
    prompt_routes_QPLK = None
    if record_routes:
        p = shape.prompt_length or prompts_RW.shape[1]  # each prompt's P entries from its start
        at_QP = start_Q[:, None] + jnp.arange(p, dtype=jnp.int32)[None, :]
        prompt_routes_QPLK = jnp.take(prefill.routes, at_QP, axis=0, mode="clip")
    return EngineResult(
        tokens_RqN=out.tokens_RqN,
        logprobs_RqN=out.logprobs_RqN,
        lengths_Rq=out.lengths_Rq,
        truncated_Rq=out.truncated_Rq,
        steps=out.step,
        compacted_steps=out.step - uncompacted.step,
        prompt_routes=prompt_routes_QPLK,
        routes_RqNLK=out.routes_RqNLK,
    )


def continue_slots(
    model: Transformer,
    shape: EngineShape,
    cache: SlotKVCache,
    *,
    lengths_Sl: jax.Array,
    new_SlE: jax.Array,
    new_lengths_Sl: jax.Array,
    keys_Sl: jax.Array,
    max_tokens_Sl: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    stop_ZV: jax.Array | None,
    mesh: Mesh | None = None,
    record_routes: bool = False,
) -> EngineResult:
    """One turn of live slots (``generate/session.py``): slot s holds ``lengths_Sl[s]`` entries;
    its ``new_lengths_Sl[s]`` new tokens (``new_SlE``, right padded) are appended at entries
    ``lengths, lengths + 1, ...`` (attending to everything the slot holds), then the slot
    generates one request from the last of them, token t drawn with ``fold_in(keys_Sl[s], t)``,
    up to ``max_tokens_Sl[s]`` tokens. Slots with ``max_tokens_Sl == 0`` sit the turn out and
    keep their entries. The result's rows are the slots (tokens and log-probs ``[Sl, N]``,
    lengths and truncation ``[Sl]``; no compaction: ``compacted_steps`` 0) and its ``cache``
    the slots' cache: a slot then holds ``lengths + new_lengths + generated`` entries (its last
    token included). With ``record_routes`` (a MoE model) also the MoE routes of the new tokens
    ``[Sl, E, Lm, K]`` (``prompt_routes``) and of the generated ones ``[Sl, N, Lm, K]`` (every
    one is fed, the last included)."""
    s, e = new_SlE.shape
    rows = lambda x: constrain_rows(x, mesh)  # noqa: E731
    cache = dataclasses.replace(
        cache,
        keys=constrain_rows(cache.keys, mesh, axis=1, tensor_axis=3),
        values=constrain_rows(cache.values, mesh, axis=1, tensor_axis=3),
    )
    idx_1E = jnp.arange(e, dtype=jnp.int32)[None, :]
    segment_ids_SlE = (idx_1E < new_lengths_Sl[:, None]).astype(jnp.int32)
    hidden_SlED, cache, new_routes = _run(
        model, record_routes, new_SlE, lengths_Sl[:, None] + idx_1E, segment_ids_SlE, cache
    )
    last_Sl = jnp.maximum(new_lengths_Sl - 1, 0)
    last_SlD = jnp.take_along_axis(hidden_SlED, last_Sl[:, None, None], axis=1)[:, 0]
    logits_SlV = model.logits(last_SlD[:, None])[:, 0]
    routes_LK = None
    if record_routes:
        routes_LK = (len(model.config.moe_layers), model.config.num_experts_per_tok)
    state = _initial_state(shape, s, logits_SlV, cache, rows, routes_LK)
    run_Sl = max_tokens_Sl > 0
    state = dataclasses.replace(
        state,
        request_Sl=jnp.where(run_Sl, jnp.arange(s, dtype=jnp.int32), -1),
        position_Sl=lengths_Sl + new_lengths_Sl,
    )
    slot_key = lambda r_Sl, t_Sl: jax.vmap(jax.random.fold_in)(keys_Sl[r_Sl], t_Sl)  # noqa: E731

    def body(state: DecodeState) -> DecodeState:
        return _decode_step(
            model, shape, state, slot_key, max_tokens_Sl, temperature, top_k, top_p, stop_ZV,
            rows, keep_idle=True, record_routes=record_routes, record_last=True,
        )  # fmt: skip

    out = lax.while_loop(lambda st: jnp.any(st.request_Sl >= 0), body, state)
    return EngineResult(
        tokens_RqN=out.tokens_RqN,
        logprobs_RqN=out.logprobs_RqN,
        lengths_Rq=out.lengths_Rq,
        truncated_Rq=out.truncated_Rq,
        steps=out.step,
        compacted_steps=jnp.zeros((), jnp.int32),
        prompt_routes=new_routes,
        routes_RqNLK=out.routes_RqNLK,
        cache=out.cache,
    )
