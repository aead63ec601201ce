"""A small stand-in LM and batch builders for engine tests (independent of the real model)."""

from __future__ import annotations

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.losses.normalize import LossTerms, token_terms


class TinyLM(nnx.Module):
    """Embedding + causal within-document mean mixing + MLP + head: packing-sensitive."""

    def __init__(self, vocab: int = 17, width: int = 8, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, width, rngs=rngs)
        self.mix = nnx.Linear(width, width, rngs=rngs)
        self.head = nnx.Linear(width, vocab, rngs=rngs)

    def __call__(self, tokens_BT, segment_ids_BT):
        x_BTD = self.embed(tokens_BT)
        T = tokens_BT.shape[-1]
        same_BTT = segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :]
        causal_TT = jnp.tril(jnp.ones((T, T), bool))
        w_BTT = (same_BTT & causal_TT[None]).astype(jnp.float32)
        w_BTT = w_BTT / jnp.sum(w_BTT, axis=-1, keepdims=True)
        ctx_BTD = jnp.einsum("bts,bsd->btd", w_BTT, x_BTD)
        return self.head(jnp.tanh(x_BTD + self.mix(ctx_BTD)))


def make_loss_fn(graphdef, *, mode: str, num_segments: int, max_len: int = 8):
    """Cross-entropy LossTerms of one micro-batch under ``mode``."""

    def loss_fn(params, mb):
        model = nnx.merge(graphdef, params)
        logits_BTV = model(mb["tokens"], mb["segment_ids"])
        logp_BTV = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
        logp_BT = jnp.take_along_axis(logp_BTV, mb["targets"][..., None], axis=-1)[..., 0]
        num, den = token_terms(
            -logp_BT,
            mb["loss_mask"],
            mb["segment_ids"],
            mode=mode,
            num_segments=num_segments,
            max_len=max_len,
        )
        nll = jnp.sum(-logp_BT * mb["loss_mask"])
        return LossTerms(num, den, {"nll": (nll, jnp.sum(mb["loss_mask"]))})

    return loss_fn


def random_docs(rng: np.random.Generator, n: int, vocab: int = 17, lo: int = 2, hi: int = 12):
    """``n`` documents of uneven lengths with a random completion mask (first token never)."""
    docs = []
    for _ in range(n):
        length = int(rng.integers(lo, hi + 1))
        tokens = rng.integers(1, vocab, size=length)
        mask = (rng.random(length) < 0.7).astype(np.float32)
        mask[0] = 0.0
        docs.append((tokens, mask))
    return docs


def build_rows(layout, docs, row_len: int, num_slots: int | None = None):
    """Pack ``layout[r][m] = [doc indices]`` into ``[R, M, T]`` arrays (segment 0 = padding).

    ``loss_mask[t]`` is the mask of token t+1 when it belongs to the same document.
    """
    R = len(layout)
    K = num_slots or max(len(rank) for rank in layout)
    out = {k: np.zeros((R, K, row_len), np.int32) for k in ("tokens", "targets", "segment_ids")}
    out["loss_mask"] = np.zeros((R, K, row_len), np.float32)
    for r, rank in enumerate(layout):
        for k, slot in enumerate(rank):
            pos = 0
            for s, d in enumerate(slot, start=1):
                toks, mask = docs[d]
                n = len(toks)
                assert pos + n <= row_len
                out["tokens"][r, k, pos : pos + n] = toks
                out["targets"][r, k, pos : pos + n - 1] = toks[1:]
                out["loss_mask"][r, k, pos : pos + n - 1] = mask[1:]
                out["segment_ids"][r, k, pos : pos + n] = s
                pos += n
    return out
