"""The trainer's head only where a value is consumed (``head.needed_chunks``, docs/performance.md):
values at the loss-mask positions equal the full head's, 0 elsewhere, and so do the gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tiny_models import one_layer

from jaxrl.models.head import token_logprobs
from jaxrl.train.forward import micro_batch_logprobs, micro_batch_scores

CHUNK, T = 8, 64  # 8 chunks of 8 positions; the sparse mask needs 2 of them
TEMP = 0.7


@pytest.fixture(scope="module")
def case():
    _, graphdef, params = one_layer(48)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 48, (1, T)).astype(np.int32)
    segment_ids = np.repeat(np.array([1, 2, 3, 0]), T // 4)[None].astype(np.int32)
    mask = np.zeros((1, T), np.float32)
    mask[0, [3, 4, 9, 20, 21, 22, 23, 24, 30, 40, 41]] = 1.0  # 11 positions, 2 chunks
    mask[0, 5] = 0.5  # a fractional weight is needed too
    mb = {
        "tokens": tokens,
        "targets": np.roll(tokens, -1, 1),
        "segment_ids": segment_ids,
        "loss_mask": mask,
    }
    return graphdef, params, mb


def _full(graphdef, params, mb, temperature):
    """Today's head over every position: ``token_logprobs`` without ``needed_BT``."""
    model = nnx.merge(graphdef, params)
    hidden_BTD = model.hidden_states(mb["tokens"], None, mb["segment_ids"])
    return token_logprobs(
        hidden_BTD,
        model.head_kernel(),
        mb["targets"],
        fp32=model.config.fp32_lm_head,
        temperature=temperature,
        chunk_size=CHUNK,
    )


def test_values_at_needed_positions_equal_the_full_head_and_zero_elsewhere(case):
    graphdef, params, mb = case
    on = mb["loss_mask"] != 0

    @jax.jit
    def both(p):
        scores = micro_batch_scores(nnx.merge(graphdef, p), mb, chunk_size=CHUNK, temperature=TEMP)
        return scores, _full(graphdef, p, mb, TEMP)

    (logp, entropy, correct), (logp_full, entropy_full) = both(params)
    logits = nnx.merge(graphdef, params)(mb["tokens"], None, mb["segment_ids"])
    hit = np.asarray(jnp.argmax(logits, -1)) == mb["targets"]
    np.testing.assert_allclose(logp[on], logp_full[on], rtol=0, atol=1e-6)
    np.testing.assert_allclose(entropy[on], entropy_full[on], rtol=0, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(correct)[on], hit[on])
    assert hit[~on].any()  # the argmax hits elsewhere too, but is not reported there
    assert not np.asarray(logp)[~on].any() and not np.asarray(entropy)[~on].any()
    assert not np.asarray(correct)[~on].any()
    # the train forward: the scorer's values; without a mask, every position, the same bits
    lp, ent = jax.jit(
        lambda p: micro_batch_logprobs(
            nnx.merge(graphdef, p), mb, chunk_size=CHUNK, temperature=TEMP
        )
    )(params)
    np.testing.assert_allclose(lp, logp, rtol=0, atol=1e-6)  # another program: rounding only
    np.testing.assert_allclose(ent, entropy, rtol=0, atol=1e-6)
    unmasked = {k: v for k, v in mb.items() if k != "loss_mask"}
    lp_all, _ = jax.jit(
        lambda p: micro_batch_logprobs(
            nnx.merge(graphdef, p), unmasked, chunk_size=CHUNK, temperature=TEMP
        )
    )(params)
    np.testing.assert_array_equal(np.asarray(lp_all)[on], np.asarray(lp)[on])  # bit for bit
    np.testing.assert_allclose(lp_all, logp_full, rtol=0, atol=1e-6)


@pytest.mark.parametrize("mask", ["sparse", "empty"])
def test_gradients_equal_the_full_head(case, mask):
    graphdef, params, mb = case
    if mask == "empty":
        mb = {**mb, "loss_mask": np.zeros_like(mb["loss_mask"])}
    w = mb["loss_mask"]

    def loss(logp, entropy):  # a sum over loss tokens, as every objective is
        on = w != 0
        return jnp.sum(jnp.where(on, w * logp + 0.1 * entropy, 0.0))

    def needed(p):
        model = nnx.merge(graphdef, p)
        return loss(*micro_batch_logprobs(model, mb, chunk_size=CHUNK, temperature=TEMP))

    def full(p):
        return loss(*_full(graphdef, p, mb, TEMP))

    (v, g), (v_full, g_full) = jax.jit(
        lambda p: (jax.value_and_grad(needed)(p), jax.value_and_grad(full)(p))
    )(params)
    np.testing.assert_allclose(v, v_full, rtol=1e-6, atol=1e-6)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_full), strict=True):
        assert np.isfinite(np.asarray(a)).all()
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    if mask == "empty":
        assert all(not np.asarray(a).any() for a in jax.tree.leaves(g))
