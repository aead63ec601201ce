"""LM head and memory-bounded token log-probabilities (docs/algorithms/accumulation.md §5).

With ``fp32=True`` the head is ``hidden.astype(f32) @ kernel.astype(f32)`` at
``Precision.HIGHEST``: bf16 products are exact in fp32, so the gain is fp32 accumulation and
fp32 logits, the numerics of a vLLM sampler with an fp32 head. Autodiff transposes the casts,
so the input and weight gradients come back in the input and weight dtypes, computed in fp32.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl.runtime.targets import target_platform


def lm_head(
    hidden: jax.Array, kernel: jax.Array, *, fp32: bool, softcap: float | None = None
) -> jax.Array:
    """Logits ``hidden[..., D] @ kernel[D, V]``; fp32 at HIGHEST precision when ``fp32``.

    Without ``fp32`` the matmul runs in the operands' dtype (bf16 logits for bf16 operands);
    :func:`token_logprobs` and ``Transformer.__call__`` first cast the kernel to the hidden dtype.
    ``softcap`` (``final_logit_softcapping``, Gemma 2): logits ``cap * tanh(logits / cap)`` in
    the logits' dtype, as transformers computes them; every chunk of the chunked heads below
    is capped before its log-softmax.
    """
    if fp32:
        logits = jnp.matmul(
            hidden.astype(jnp.float32),
            kernel.astype(jnp.float32),
            precision=lax.Precision.HIGHEST,
        )
    else:
        logits = jnp.matmul(hidden, kernel)
    if softcap is None:
        return logits
    cap = jnp.asarray(softcap, logits.dtype)
    return jnp.tanh(logits / cap) * cap


def _chunk_logprobs(
    hidden_BCD: jax.Array,
    kernel_DV: jax.Array,
    targets_BC: jax.Array,
    *,
    fp32: bool,
    temperature: float | jax.Array,
    softcap: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    # The kernel arrives as an fp32 copy so that its gradient is summed over chunks in fp32.
    # Without fp32 the head runs in the hidden dtype, as in Transformer.__call__.
    if not fp32:
        kernel_DV = kernel_DV.astype(hidden_BCD.dtype)
    logits_BCV = lm_head(hidden_BCD, kernel_DV, fp32=fp32, softcap=softcap)
    logits_BCV = logits_BCV.astype(jnp.float32) / temperature
    lse_BC = jax.nn.logsumexp(logits_BCV, axis=-1)
    target_logit_BC = jnp.take_along_axis(logits_BCV, targets_BC[..., None], axis=-1, mode="clip")[
        ..., 0
    ]
    probs_BCV = jnp.exp(logits_BCV - lse_BC[..., None])
    entropy_BC = lse_BC - jnp.sum(probs_BCV * logits_BCV, axis=-1)
    return target_logit_BC - lse_BC, entropy_BC


AUTO_CHUNK_LOGITS = 1 << 27  # logits values one chunk may hold when the chunk is automatic


def auto_chunk(vocab_size: int) -> int:
    """The token chunk of ``logprob_chunk: 0``: the largest power of two whose ``[chunk, V]``
    logits hold at most ``AUTO_CHUNK_LOGITS`` values (512 MB in fp32), at least 128 tokens. Rows
    no longer than that run as one chunk, so small vocabularies never chunk."""
    return max(128, 1 << max(AUTO_CHUNK_LOGITS // max(vocab_size, 1), 1).bit_length() - 1)


def vocab_parallel_scores(
    hidden_BCD: jax.Array,
    kernel_DVl: jax.Array,
    targets_BC: jax.Array,
    *,
    fp32: bool,
    temperature: float | jax.Array,
    axis: str,
    softcap: float | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`_chunk_logprobs` plus the argmax hit (``logp``, ``entropy``, ``correct``) of this
    rank's tokens, inside a per-rank program where the head is split over its vocabulary across
    the mesh axis ``axis`` (rank r holds columns ``[r Vl, (r + 1) Vl)``: ``kernel_DVl``).

    Vocabulary-parallel cross-entropy (Megatron's, over ``axis``): the ranks' hidden states
    are gathered (``[Rf · B, C, D]``, small), each rank computes the logits of every rank's tokens
    over its columns, and per-token statistics are combined with ``pmax`` / ``psum``:
    ``lse = M + log Σ_r Σ_v exp(z - M)``, the target logit from the rank that holds it, the
    entropy's ``Σ p z``, and the first index of the global maximum (``jnp.argmax``'s tie rule).
    The kernel is never gathered and its gradient is this rank's columns for every token (no
    reduction over ``axis``); the hidden states' gradient leaves through the gather's transpose
    (a reduce-scatter). Values equal :func:`_chunk_logprobs` to float rounding (the sums run in
    another order)."""
    b, _, _ = hidden_BCD.shape
    rank, v_local = jax.lax.axis_index(axis), kernel_DVl.shape[1]
    v_total = v_local * jax.lax.psum(1, axis)
    # gathered in fp32 (exact), so the hidden states' gradient is reduce-scattered in fp32
    hidden_RfBCD = jax.lax.all_gather(hidden_BCD.astype(jnp.float32), axis, axis=0, tiled=True)
    hidden_RfBCD = hidden_RfBCD.astype(hidden_BCD.dtype)
    raw_RfBC = jax.lax.all_gather(targets_BC, axis, axis=0, tiled=True)
    if not fp32:
        kernel_DVl = kernel_DVl.astype(hidden_BCD.dtype)
    logits_RfBCV = lm_head(hidden_RfBCD, kernel_DVl, fp32=fp32, softcap=softcap)
    z_RfBCV = logits_RfBCV.astype(jnp.float32) / temperature
    m_RfBC = jax.lax.pmax(jax.lax.stop_gradient(jnp.max(z_RfBCV, axis=-1)), axis)
    sum_RfBC = jax.lax.psum(jnp.sum(jnp.exp(z_RfBCV - m_RfBC[..., None]), axis=-1), axis)
    lse_RfBC = m_RfBC + jnp.log(sum_RfBC)
    local_RfBC = jnp.clip(raw_RfBC, 0, v_total - 1) - rank * v_local  # targets clamped to [0, V)
    inside_RfBC = (local_RfBC >= 0) & (local_RfBC < v_local)
    at_RfBC = jnp.clip(local_RfBC, 0, v_local - 1)[..., None]
    target_RfBC = jnp.take_along_axis(z_RfBCV, at_RfBC, axis=-1)[..., 0]
    target_RfBC = jax.lax.psum(jnp.where(inside_RfBC, target_RfBC, 0.0), axis)
    probs_RfBCV = jnp.exp(z_RfBCV - lse_RfBC[..., None])
    entropy_RfBC = lse_RfBC - jax.lax.psum(jnp.sum(probs_RfBCV * z_RfBCV, axis=-1), axis)
    top_RfBC = jax.lax.stop_gradient(jnp.max(logits_RfBCV, axis=-1)).astype(jnp.float32)
    first_RfBC = jnp.argmax(logits_RfBCV, axis=-1).astype(jnp.int32) + rank * v_local
    best_RfBC = jax.lax.pmax(top_RfBC, axis)
    first_RfBC = jax.lax.pmin(jnp.where(top_RfBC == best_RfBC, first_RfBC, v_total), axis)

    def mine(x_RfBC: jax.Array) -> jax.Array:
        return jax.lax.dynamic_slice_in_dim(x_RfBC, rank * b, b, axis=0)

    logp_RfBC = target_RfBC - lse_RfBC
    return mine(logp_RfBC), mine(entropy_RfBC), mine(first_RfBC == raw_RfBC)


def token_logprobs(
    hidden_BTD: jax.Array,
    kernel_DV: jax.Array | Callable[[], jax.Array],
    targets_BT: jax.Array,
    *,
    fp32: bool,
    temperature: float | jax.Array = 1.0,
    chunk_size: int | None = None,
    vocab_axis: str | None = None,
    needed_BT: jax.Array | None = None,
    softcap: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Log-probability of each target and the entropy, both float32 [B, T].

    With ``z = (hidden @ kernel) / temperature`` (the head as in :func:`lm_head`)::

        logp[b, t]    = z[b, t, targets[b, t]] - logsumexp(z[b, t])
        entropy[b, t] = logsumexp(z[b, t]) - sum_v softmax(z[b, t])_v z[b, t, v]

    The T axis is processed ``chunk_size`` tokens at a time under ``jax.checkpoint``, so no
    more than one chunk's [B, chunk, V] logits exist at once, forward or backward
    (``None``: one chunk). T need not be a multiple of ``chunk_size``. Targets outside
    ``[0, V)`` are clamped (give such tokens zero loss weight). Without ``fp32`` the head runs
    in the hidden dtype. The kernel's gradient is accumulated over chunks in fp32 and returned
    in the kernel's dtype. ``vocab_axis``: inside a per-rank program, the kernel is this rank's
    columns of a head split over that mesh axis (:func:`vocab_parallel_scores`).
    ``needed_BT``: compute only where it is non-zero (e.g. the loss mask), in chunks of
    ``chunk_size`` needed positions (:func:`needed_chunks`); 0 elsewhere. ``kernel_DV`` may be
    a function that returns it: with ``needed_BT`` it is called inside each chunk's ``lax.cond``
    branch, so a transposed (tied) kernel enters the branch as stored and XLA folds the
    transpose into the matmul instead of copying it (its gradient is then summed over chunks
    in the dtype of what the function reads: pass one only for fp32 weights).
    ``softcap``: the final logit soft-cap (:func:`lm_head`), applied to each chunk's logits
    before the temperature and the log-softmax.
    """
    b, t, d = hidden_BTD.shape
    if callable(kernel_DV) and needed_BT is None:
        kernel_DV = kernel_DV()
    if callable(kernel_DV):  # read inside each chunk; its gradient is summed in its dtype
        make_kernel = kernel_DV
        kernel32 = lambda: make_kernel().astype(jnp.float32)  # noqa: E731
    else:  # an fp32 copy, so that its gradient is summed over chunks in fp32
        kernel32_DV = kernel_DV.astype(jnp.float32)
        kernel32 = lambda: kernel32_DV  # noqa: E731
    kernel_shape = jax.eval_shape(kernel32).shape
    if kernel_shape[0] != d or targets_BT.shape != (b, t):
        raise ValueError(
            f"token_logprobs: hidden {hidden_BTD.shape}, kernel {kernel_shape} and targets "
            f"{targets_BT.shape} must be [B, T, D], [D, V] and [B, T]"
        )
    chunk = t if chunk_size is None else int(chunk_size)
    if chunk <= 0:
        raise ValueError(f"token_logprobs: chunk_size={chunk_size} must be a positive int")

    def scores(hidden_BCD: jax.Array, targets_BC: jax.Array) -> tuple[jax.Array, jax.Array]:
        kernel32_DV = kernel32()
        if vocab_axis is not None:
            return vocab_parallel_scores(
                hidden_BCD,
                kernel32_DV,
                targets_BC,
                fp32=fp32,
                temperature=temperature,
                axis=vocab_axis,
                softcap=softcap,
            )[:2]
        return _chunk_logprobs(
            hidden_BCD,
            kernel32_DV,
            targets_BC,
            fp32=fp32,
            temperature=temperature,
            softcap=softcap,
        )

    if needed_BT is not None:
        return needed_chunks(
            scores,
            hidden_BTD,
            targets_BT,
            needed_BT,
            chunk,
            dtypes=(jnp.float32, jnp.float32),
            sync_axis=vocab_axis,
            remat=True,
        )
    hidden_NcBCD, targets_NcBC = split_chunks(hidden_BTD, targets_BT, chunk)
    logp_NcBC, entropy_NcBC = lax.map(
        jax.checkpoint(lambda xs: scores(*xs)), (hidden_NcBCD, targets_NcBC)
    )
    return join_chunks(logp_NcBC, t), join_chunks(entropy_NcBC, t)


NEEDED_CHUNK = 256  # positions per chunk of the trainer's head (train/forward.py), at most
NEEDED_CHUNK_CPU = 128  # the same on a CPU (:func:`needed_chunk`)


def needed_chunk(platform: str | None = None) -> int:
    """The most needed positions per chunk of the trainer's head on ``platform`` (default: the
    backend jax runs on). The last chunk is mostly padding (280 loss positions run as 2 x 256
    or 3 x 128). On a CPU a chunk's matmul is compute-bound at 128 rows, so smaller chunks
    waste less (SmolLM2-135M's GRPO row: forward + backward 4.13-4.15 s against 4.51-4.61 s,
    docs/performance.md); on an accelerator each chunk re-reads the ``[D, V]`` kernel, which
    256 rows keep compute-bound."""
    return NEEDED_CHUNK_CPU if (platform or target_platform()) == "cpu" else NEEDED_CHUNK


def needed_chunks(
    body: Callable[[jax.Array, jax.Array], tuple[jax.Array, ...]],
    hidden_BTD: jax.Array,
    targets_BT: jax.Array,
    needed_BT: jax.Array,
    chunk: int,
    *,
    dtypes: tuple[jax.typing.DTypeLike, ...],
    sync_axis: str | None = None,
    remat: bool = False,
) -> tuple[jax.Array, ...]:
    """``body``'s per-token values ``[B, T]`` (one per dtype of ``dtypes``), computed only where
    ``needed_BT`` is non-zero; exactly 0 (False) elsewhere.

    ``body(hidden_1CD, targets_1C)`` returns a tuple of ``[1, C]`` arrays. The needed positions
    are compacted in order (``jnp.nonzero`` at the static size B·T) and cut into Nc chunks of
    C = ``min(chunk, B·T)``; ``lax.map`` runs the chunks that hold a needed position and
    ``lax.cond`` skips the rest, forward and backward, so the program's shapes never depend on
    the mask. A needed position's values are those of a ``[1, C]`` chunk of the full head:
    the same arithmetic, whatever the other rows of its chunk. ``sync_axis``: inside a
    per-rank program whose ``body`` runs collectives over that mesh axis (the
    vocabulary-parallel head), every rank of the axis runs the largest chunk count among them
    (``pmax``), so their collectives stay matched; the extra chunks gather no row and their
    values are dropped. ``remat``: each chunk under ``jax.checkpoint`` (as ``token_logprobs``'s
    chunks), taken around the ``lax.cond`` so that the backward saves only the chunk's indices
    and a skipped chunk costs nothing (inside the cond, each skipped chunk would stack a
    zero-filled copy of the kernel as a residual).
    """
    b, t, d = hidden_BTD.shape
    n = b * t
    c = min(int(chunk), n)
    n_chunks = -(-n // c)
    needed_T = jnp.reshape(needed_BT, (n,)) != 0
    (at_T,) = jnp.nonzero(needed_T, size=n_chunks * c, fill_value=n)  # n: no position
    todo = (jnp.sum(needed_T, dtype=jnp.int32) + c - 1) // c
    if sync_axis is not None:
        todo = lax.pmax(todo, sync_axis)
    hidden_TD = jnp.reshape(hidden_BTD, (n, d))
    targets_T = jnp.reshape(targets_BT, (n,))

    def run(at_C: jax.Array) -> tuple[jax.Array, ...]:
        hidden_1CD = jnp.take(hidden_TD, at_C, axis=0, mode="fill", fill_value=0)[None]
        targets_1C = jnp.take(targets_T, at_C, axis=0, mode="fill", fill_value=0)[None]
        outs = body(hidden_1CD, targets_1C)
        return tuple(x.astype(dt) for x, dt in zip(outs, dtypes, strict=True))

    def skip(at_C: jax.Array) -> tuple[jax.Array, ...]:
        return tuple(jnp.zeros((1, c), dt) for dt in dtypes)

    def step(xs: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, ...]:
        i, at_C = xs
        return lax.cond(i < todo, run, skip, at_C)

    if remat:  # outside the cond: a skipped chunk saves and recomputes nothing
        step = jax.checkpoint(step)

    at_NcC = at_T.reshape(n_chunks, c)
    outs_NcC = lax.map(step, (jnp.arange(n_chunks, dtype=jnp.int32), at_NcC))
    return tuple(
        jnp.zeros((n,), x_NcC.dtype).at[at_T].set(x_NcC.reshape(-1), mode="drop").reshape(b, t)
        for x_NcC in outs_NcC
    )


def split_chunks(
    hidden_BTD: jax.Array, targets_BT: jax.Array, chunk: int
) -> tuple[jax.Array, jax.Array]:
    """``(hidden_NcBCD, targets_NcBC)``: the T axis cut into Nc chunks of ``min(chunk, T)`` tokens
    (the last zero-padded), chunk-major for ``lax.map``."""
    b, t, d = hidden_BTD.shape
    chunk = min(int(chunk), t)
    n_chunks = -(-t // chunk)
    pad = n_chunks * chunk - t
    hidden_NcBCD = jnp.pad(hidden_BTD, ((0, 0), (0, pad), (0, 0)))
    hidden_NcBCD = hidden_NcBCD.reshape(b, n_chunks, chunk, d).swapaxes(0, 1)
    targets_NcBC = jnp.pad(targets_BT, ((0, 0), (0, pad))).reshape(b, n_chunks, chunk)
    return hidden_NcBCD, targets_NcBC.swapaxes(0, 1)


def join_chunks(x_NcBC: jax.Array, t: int) -> jax.Array:
    """``[B, T]`` from per-chunk values ``[Nc, B, C]`` (:func:`split_chunks`), padding dropped."""
    n, b, c = x_NcBC.shape
    return x_NcBC.swapaxes(0, 1).reshape(b, n * c)[:, :t]
