"""The trainer's forward: packed micro-batch → per-token log-probs and entropy (fp32).

:func:`micro_batch_logprobs` is what every loss calls; :func:`micro_batch_scores` is the same
computation (same hidden states, same head, same chunking) plus the teacher-forced argmax hit,
for the no-grad scorer (``jaxrl.train.score``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl.models.fsdp import rows_per_chunk
from jaxrl.models.head import (
    auto_chunk,
    join_chunks,
    split_chunks,
    token_logprobs,
    vocab_parallel_scores,
)
from jaxrl.models.moe.trace import MoeTrace, batch_routes
from jaxrl.models.transformer import Transformer

ROUTE_REPLAY = "moe_replay"  # a micro-batch field ([1]) whose presence turns router replay on


def micro_batch_logprobs(
    model: Transformer,
    mb: dict[str, jax.Array],
    *,
    chunk_size: int | None = None,
    temperature: float | jax.Array = 1.0,
) -> tuple[jax.Array, jax.Array]:
    """``(logp_BT, entropy_BT)`` of ``mb["targets"]`` given ``mb["tokens"]`` (target-aligned).

    Positions restart per document (from ``segment_ids``) unless ``mb`` carries ``positions``.
    The head is the model's (fp32 when ``fp32_lm_head``), chunked over tokens.
    """
    hidden_BTD = _hidden_states(model, mb)
    return _head_logprobs(model, hidden_BTD, mb["targets"], chunk_size, temperature)


def micro_batch_scores(
    model: Transformer,
    mb: dict[str, jax.Array],
    *,
    chunk_size: int | None = None,
    temperature: float | jax.Array = 1.0,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(logp_BT, entropy_BT, correct_BT)``: :func:`micro_batch_logprobs` and whether the argmax
    of the model's logits (``Transformer.logits``, before the temperature) is the target.

    ``correct`` is teacher-forced exact match per token: a document whose loss tokens are all
    correct is what greedy decoding reproduces (each greedy step then sees a correct prefix).
    The head runs ``chunk_size`` tokens at a time as in ``token_logprobs`` (each chunk through
    ``token_logprobs`` itself), and the argmax reads the same chunk's logits, so XLA computes
    each chunk's logits once.
    """
    hidden_BTD = _hidden_states(model, mb)
    t = hidden_BTD.shape[1]
    chunk = _chunk(model, chunk_size, t)
    hidden_NBCD, targets_NBC = split_chunks(hidden_BTD, mb["targets"], chunk)

    def body(xs: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array, jax.Array]:
        hidden_BCD, targets_BC = xs
        shard = model.head_shard()
        if shard is not None:  # ZeRO-3: vocabulary-parallel, never gathered
            kernel_DVl, axis = shard
            return vocab_parallel_scores(
                hidden_BCD,
                kernel_DVl.astype(jnp.float32),
                targets_BC,
                fp32=model.config.fp32_lm_head,
                temperature=temperature,
                axis=axis,
            )
        logp_BC, entropy_BC = _head_logprobs(model, hidden_BCD, targets_BC, None, temperature)
        correct_BC = jnp.argmax(model.logits(hidden_BCD), axis=-1) == targets_BC
        return logp_BC, entropy_BC, correct_BC

    outs = lax.map(body, (hidden_NBCD, targets_NBC))
    return tuple(join_chunks(x, t) for x in outs)


def _hidden_states(model: Transformer, mb: dict[str, jax.Array]) -> jax.Array:
    if model.config.moe_layers and ROUTE_REPLAY in mb:  # router replay (docs/moe.md)
        return routed_hidden_states(model, mb)[0]
    return model.hidden_states(
        mb["tokens"], mb.get("positions"), mb["segment_ids"], mb.get("parent_ids")
    )


def routed_hidden_states(
    model: Transformer, mb: dict[str, jax.Array]
) -> tuple[jax.Array, MoeTrace, jax.Array | None]:
    """A MoE model's hidden states, its routing (``MoeTrace``) and the micro-batch's recorded
    routes (``moe/trace.py``; None when it carries none). With ``mb[ROUTE_REPLAY]`` (set by the
    trainer for ``grpo.router_replay: rollout``) the forward replays the recorded routes."""
    recorded = batch_routes(mb, model.config)
    replay = recorded if ROUTE_REPLAY in mb else None
    hidden_BTD, trace = model.routed_hidden_states(
        mb["tokens"],
        mb.get("positions"),
        mb["segment_ids"],
        replay_routes=replay,
        parent_ids=mb.get("parent_ids"),
    )
    return hidden_BTD, trace, recorded


def routed_logprobs(
    model: Transformer,
    mb: dict[str, jax.Array],
    *,
    chunk_size: int | None = None,
    temperature: float | jax.Array = 1.0,
) -> tuple[jax.Array, jax.Array, MoeTrace, jax.Array | None]:
    """:func:`micro_batch_logprobs` of a MoE model with :func:`routed_hidden_states`'s
    routing and recorded routes."""
    hidden_BTD, trace, recorded = routed_hidden_states(model, mb)
    logp_BT, entropy_BT = _head_logprobs(model, hidden_BTD, mb["targets"], chunk_size, temperature)
    return logp_BT, entropy_BT, trace, recorded


def _head_logprobs(
    model: Transformer,
    hidden_BTD: jax.Array,
    targets_BT: jax.Array,
    chunk_size: int | None,
    temperature: float | jax.Array,
) -> tuple[jax.Array, jax.Array]:
    shard = model.head_shard()  # ZeRO-3: vocabulary-parallel, never gathered
    kernel_DV, axis = shard if shard else (model.head_kernel(model.head_dtype(hidden_BTD)), None)
    return token_logprobs(
        hidden_BTD,
        kernel_DV,
        targets_BT,
        fp32=model.config.fp32_lm_head,
        temperature=temperature,
        chunk_size=_chunk(model, chunk_size, hidden_BTD.shape[1]),
        vocab_axis=axis,
    )


def _chunk(model: Transformer, chunk_size: int | None, tokens: int) -> int:
    """The head's token chunk: ``chunk_size``, else ``auto_chunk``; a vocabulary-parallel head
    (ZeRO-3) takes at most ``fsdp.rows_per_chunk`` (it runs every rank's tokens of a chunk)."""
    chunk = chunk_size or auto_chunk(model.config.vocab_size)
    shard = model.head_shard()
    if shard is not None:
        kernel_DVl, axis = shard
        chunk = min(chunk, rows_per_chunk(axis, kernel_DVl.shape[0], tokens))
    return chunk
