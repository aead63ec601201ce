"""The trainer's forward: packed micro-batch → per-token log-probs and entropy (fp32).

:func:`micro_batch_logprobs` is what every loss calls; :func:`micro_batch_scores` is the same
computation (same hidden states, same head, same chunking) plus the teacher-forced argmax hit,
for the no-grad scorer (``jaxrl.train.score``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.models.fsdp import rows_per_chunk
from jaxrl.models.head import (
    auto_chunk,
    needed_chunk,
    needed_chunks,
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
    The head is the model's (fp32 when ``fp32_lm_head``), chunked over the positions where
    ``mb["loss_mask"]`` is non-zero (all without one); 0 elsewhere.
    """
    hidden_BTD = _hidden_states(model, mb)
    return _needed_logprobs(model, hidden_BTD, mb, chunk_size, temperature)


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
    The head runs on the chunks of needed positions of :func:`micro_batch_logprobs` (each chunk
    through ``token_logprobs`` itself), and the argmax reads the same chunk's logits, so XLA
    computes each chunk's logits once.
    """
    hidden_BTD = _hidden_states(model, mb)
    shard = model.head_shard()

    def body(hidden_1CD: jax.Array, targets_1C: jax.Array) -> tuple[jax.Array, ...]:
        if shard is not None:  # ZeRO-3: vocabulary-parallel, never gathered
            kernel_DVl, axis = shard
            return vocab_parallel_scores(
                hidden_1CD,
                kernel_DVl.astype(jnp.float32),
                targets_1C,
                fp32=model.config.fp32_lm_head,
                temperature=temperature,
                axis=axis,
                softcap=model.config.final_logit_softcapping,
            )
        logp_1C, entropy_1C = _head_logprobs(model, hidden_1CD, targets_1C, None, temperature)
        correct_1C = jnp.argmax(model.logits(hidden_1CD), axis=-1) == targets_1C
        return logp_1C, entropy_1C, correct_1C

    return needed_chunks(
        body,
        hidden_BTD,
        mb["targets"],
        _needed(mb),
        _chunk(model, chunk_size, hidden_BTD.shape[1]),
        dtypes=(jnp.float32, jnp.float32, jnp.bool_),
        sync_axis=None if shard is None else shard[1],
    )


def _hidden_states(model: Transformer, mb: dict[str, jax.Array]) -> jax.Array:
    if model.config.moe_layers and ROUTE_REPLAY in mb:  # router replay (docs/moe.md)
        hidden_BTD, _, _ = routed_hidden_states(model, mb)
        return hidden_BTD
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
    logp_BT, entropy_BT = _needed_logprobs(model, hidden_BTD, mb, chunk_size, temperature)
    return logp_BT, entropy_BT, trace, recorded


def _needed_logprobs(
    model: Transformer,
    hidden_BTD: jax.Array,
    mb: dict[str, jax.Array],
    chunk_size: int | None,
    temperature: float | jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """:func:`_head_logprobs` of ``mb["targets"]`` at the positions of :func:`_needed`."""
    chunk = _chunk(model, chunk_size, hidden_BTD.shape[1])
    return _head_logprobs(model, hidden_BTD, mb["targets"], chunk, temperature, _needed(mb))


def _head_logprobs(
    model: Transformer,
    hidden_BTD: jax.Array,
    targets_BT: jax.Array,
    chunk: int | None,
    temperature: float | jax.Array,
    needed_BT: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    shard = model.head_shard()  # ZeRO-3: vocabulary-parallel, never gathered
    if shard:
        kernel_DV, axis = shard
    else:
        dtype, axis = model.head_dtype(hidden_BTD), None
        kernel_DV = model.head_kernel(dtype)
        if needed_BT is not None and kernel_DV.dtype == jnp.float32:
            # the needed chunks read the (tied: transposed) fp32 kernel inside their branch,
            # where XLA folds the transpose into the matmul
            kernel_DV = lambda: model.head_kernel(dtype)  # noqa: E731
    return token_logprobs(
        hidden_BTD,
        kernel_DV,
        targets_BT,
        fp32=model.config.fp32_lm_head,
        temperature=temperature,
        chunk_size=chunk,
        vocab_axis=axis,
        needed_BT=needed_BT,
        softcap=model.config.final_logit_softcapping,
    )


def _needed(mb: dict[str, jax.Array]) -> jax.Array:
    """Where the head runs: ``loss_mask != 0`` (every position of a micro-batch without one)."""
    if "loss_mask" in mb:
        return mb["loss_mask"] != 0
    return jnp.ones(mb["targets"].shape, bool)


def _chunk(model: Transformer, chunk_size: int | None, tokens: int) -> int:
    """The head's chunk of needed positions: ``chunk_size``, else ``auto_chunk``, at most
    ``needed_chunk()`` (128 on a CPU, 256 elsewhere); a vocabulary-parallel head (ZeRO-3)
    takes at most ``fsdp.rows_per_chunk`` (it runs every rank's tokens of a chunk)."""
    chunk = min(chunk_size or auto_chunk(model.config.vocab_size), needed_chunk())
    shard = model.head_shard()
    if shard is not None:
        kernel_DVl, axis = shard
        chunk = min(chunk, rows_per_chunk(axis, kernel_DVl.shape[0], tokens))
    return chunk
