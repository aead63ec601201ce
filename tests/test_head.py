"""LM head (docs/algorithms/accumulation.md §5.1) and chunked token log-probabilities against
float64 numpy."""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from jaxrl.models import ModelConfig, Transformer, lm_head, token_logprobs

# Qwen2.5-0.5B width; V reduced from 151,936 for CPU (docs/algorithms/accumulation.md §5.1)
N, H, V = 64, 896, 32768


def _log_softmax64(logits: np.ndarray) -> np.ndarray:
    logits = logits.astype(np.float64)
    top = logits.max(-1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))


@pytest.fixture(scope="module")
def operands():
    """bf16-rounded h ~ N(0,1), W ~ N(0, (4/sqrt(H))^2), and their exact float64 logits."""
    rng = np.random.default_rng(0)
    h = rng.standard_normal((N, H), np.float32).astype(ml_dtypes.bfloat16)
    w = (rng.standard_normal((H, V), np.float32) * (4 / np.sqrt(H))).astype(ml_dtypes.bfloat16)
    logits64 = h.astype(np.float64) @ w.astype(np.float64)
    return h, w, logits64


@pytest.mark.parametrize("targets_kind", ["argmax", "random"])
def test_fp32_head_logprobs_match_float64_and_bf16_head_does_not(operands, targets_kind):
    h, w, logits64 = operands
    if targets_kind == "argmax":
        targets = logits64.argmax(-1)
    else:
        targets = np.random.default_rng(1).integers(0, V, N)
    ref = np.take_along_axis(_log_softmax64(logits64), targets[:, None], -1)[:, 0]
    errors = {}
    for fp32 in (True, False):
        logp, _ = jax.jit(token_logprobs, static_argnames="fp32")(
            jnp.asarray(h)[None], jnp.asarray(w), jnp.asarray(targets)[None], fp32=fp32
        )
        assert logp.dtype == jnp.float32
        errors[fp32] = np.abs(np.asarray(logp[0], np.float64) - ref).max()
    assert errors[True] < 1e-4, errors
    assert errors[False] > 1e-3, errors  # the test can tell the two heads apart


def test_fp32_head_logits_and_gradient_dtypes(operands):
    h, w, logits64 = operands
    h, w = jnp.asarray(h), jnp.asarray(w)
    logits = jax.jit(lambda h, w: lm_head(h, w, fp32=True))(h, w)
    assert logits.dtype == jnp.float32
    assert np.abs(np.asarray(logits, np.float64) - logits64).max() < 1e-4
    assert lm_head(h[:2], w[:, :8], fp32=False).dtype == jnp.bfloat16
    gh, gw = jax.grad(lambda h, w: jnp.sum(lm_head(h, w, fp32=True)), argnums=(0, 1))(
        h[:4], w[:, :16]
    )
    assert gh.dtype == jnp.bfloat16 and gw.dtype == jnp.bfloat16


def test_fp32_head_weight_gradient_is_fp32_accurate_before_the_bf16_cast(operands):
    h, w, _ = operands
    g = (np.random.default_rng(2).standard_normal((N, V), np.float32) * 1e-3).astype(np.float32)
    h_bf, w_bf, g_j = jnp.asarray(h), jnp.asarray(w), jnp.asarray(g)

    @jax.jit  # everything as arguments: XLA would constant-fold a closed-over h^T g slowly
    def vjp_w(h_any: jax.Array, w_any: jax.Array, g_any: jax.Array) -> jax.Array:
        return jax.vjp(lambda w_: lm_head(h_any, w_, fp32=True), w_any)[1](g_any)[0]

    # Differentiating w.r.t. an fp32 copy of the bf16 weight exposes the pre-cast gradient.
    gw32 = np.asarray(vjp_w(h_bf, w_bf.astype(jnp.float32), g_j))
    ref = h.astype(np.float64).T @ g.astype(np.float64)
    rel = np.linalg.norm(gw32 - ref) / np.linalg.norm(ref)
    assert gw32.dtype == np.float32 and rel < 1e-5, rel
    gw_bf = vjp_w(h_bf, w_bf, g_j)  # the real path: the same numbers, rounded to bf16 once
    assert gw_bf.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(gw_bf), gw32.astype(ml_dtypes.bfloat16))


def _dot_precisions(jaxpr) -> list:
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(eqn.params["precision"])
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += _dot_precisions(sub)
    return found


def test_fp32_head_forward_and_backward_matmuls_request_highest_precision():
    """On GPU the default fp32 matmul may be TF32; both head matmuls must say HIGHEST."""
    h, w = jnp.ones((3, 8), jnp.bfloat16), jnp.ones((8, 5), jnp.bfloat16)
    highest = jax.lax.Precision.HIGHEST
    for fp32, want in ((True, True), (False, False)):
        loss = lambda h, w, fp32=fp32: jnp.sum(lm_head(h, w, fp32=fp32))  # noqa: E731
        with jax.default_matmul_precision("default"):  # undo conftest's global "highest"
            jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(h, w).jaxpr
        precisions = _dot_precisions(jaxpr)
        assert len(precisions) == 3  # forward, input transpose, weight transpose
        assert all(p == (highest, highest) for p in precisions) == want, precisions


@pytest.mark.slow
@pytest.mark.parametrize("tied", [True, False])
def test_model_with_fp32_head_gives_fp32_logits_and_grads_reach_the_parameter(tied):
    config = ModelConfig.tiny(
        128, hidden_size=64, num_hidden_layers=1, intermediate_size=128,
        param_dtype="bfloat16", fp32_lm_head=True, tie_word_embeddings=tied,
    )  # fmt: skip
    model = Transformer(config, rngs=nnx.Rngs(0))
    ids = jnp.arange(8).reshape(1, 8)  # tokens 8..127 never appear in the input
    graphdef, state = nnx.split(model)

    def loss(state):
        m = nnx.merge(graphdef, state)
        logits = m(ids)
        ref = lm_head(m.hidden_states(ids), m.head_kernel(), fp32=True)
        return jnp.sum(jax.nn.log_softmax(logits)[..., 3]), (logits, ref)

    grads, (logits, ref) = jax.jit(jax.grad(loss, has_aux=True))(state)
    assert logits.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(ref))
    emb_grad = np.asarray(grads["embedding"][...].astype(jnp.float32))
    assert grads["embedding"][...].dtype == jnp.bfloat16
    # Rows of unseen tokens get gradient only through a tied head.
    assert (np.abs(emb_grad[8:]).max() > 0) == tied
    if not tied:
        assert grads["lm_head"][...].dtype == jnp.bfloat16
        assert np.abs(np.asarray(grads["lm_head"][...].astype(jnp.float32))).max() > 0


def _reference(h, w, targets, temperature):
    z = (h.astype(np.float64) @ w.astype(np.float64)) / temperature
    logp_all = _log_softmax64(z)
    logp = np.take_along_axis(logp_all, targets[..., None], -1)[..., 0]
    entropy = -(np.exp(logp_all) * logp_all).sum(-1)
    return logp, entropy


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_chunked_token_logprobs_equal_unchunked_and_float64(dtype):
    rng = np.random.default_rng(3)
    b, t, d, v, temperature = 2, 13, 32, 64, 0.7
    h = jnp.asarray(rng.standard_normal((b, t, d)), dtype)
    w = jnp.asarray(rng.standard_normal((d, v)) / np.sqrt(d) * 3, dtype)
    targets = jnp.asarray(rng.integers(0, v, (b, t)))
    ref_logp, ref_entropy = _reference(np.asarray(h), np.asarray(w), np.asarray(targets), 0.7)
    fp32 = dtype == "bfloat16"  # the bf16 case runs the fp32 head

    def run(chunk_size):
        def loss(h, w):
            logp, ent = token_logprobs(h, w, targets, fp32=fp32, temperature=temperature,
                                       chunk_size=chunk_size)  # fmt: skip
            return jnp.sum(logp * jnp.cos(jnp.arange(t))[None]) + 0.3 * jnp.sum(ent), (logp, ent)

        return jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))(h, w)

    (gh, gw), (logp, ent) = run(None)
    assert logp.dtype == ent.dtype == jnp.float32 and gh.dtype == gw.dtype == h.dtype
    np.testing.assert_allclose(np.asarray(logp), ref_logp, atol=2e-5)
    np.testing.assert_allclose(np.asarray(ent), ref_entropy, atol=2e-5)
    for chunk in (4,):  # 4 does not divide T = 13; None (above) is one chunk
        (gh_c, gw_c), (logp_c, ent_c) = run(chunk)
        np.testing.assert_allclose(np.asarray(logp_c), np.asarray(logp), atol=1e-6)
        np.testing.assert_allclose(np.asarray(ent_c), np.asarray(ent), atol=1e-6)
        tol = 1e-6 if dtype == "float32" else 1e-2  # bf16: one rounding of the same fp32 sum
        np.testing.assert_allclose(np.asarray(gh_c, np.float32), np.asarray(gh, np.float32),
                                   atol=tol, rtol=tol)  # fmt: skip
        np.testing.assert_allclose(np.asarray(gw_c, np.float32), np.asarray(gw, np.float32),
                                   atol=tol, rtol=tol)  # fmt: skip


def _largest_intermediate(jaxpr) -> int:
    size = 0
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            size = max(size, int(np.prod(getattr(var.aval, "shape", ()))))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            size = max(size, _largest_intermediate(sub))
    return size


def test_chunking_bounds_the_largest_logits_buffer_in_forward_and_backward():
    b, t, d, v = 2, 64, 8, 512
    h, w = jnp.ones((b, t, d)), jnp.ones((d, v))
    targets = jnp.zeros((b, t), jnp.int32)

    def largest(chunk_size):
        loss = lambda h, w: jnp.sum(  # noqa: E731
            token_logprobs(h, w, targets, fp32=True, chunk_size=chunk_size)[0]
        )
        return _largest_intermediate(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(h, w).jaxpr)

    assert largest(None) >= b * t * v  # the check sees a full [B, T, V] buffer when there is one
    assert largest(8) <= b * 8 * v
