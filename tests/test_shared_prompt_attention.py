"""Parent segments (shared-prompt packing): a query also sees its parent document.

``[p[:-1] | p[-1] c1 | p[-1] c2 | ...]`` with the completions' parent = the prompt's segment lays
a GRPO group out once per row. The dense rule is checked against a float64 numpy evaluation,
``flash`` (and the Pallas entry points, which run flash for parents) against the dense rule,
forward and backward, and the model gives the unshared rows' log-probs and parameter gradients.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.models import ModelConfig, Transformer
from jaxrl.models.attention.dense import attention
from jaxrl.models.attention.dispatch import attention_fn
from jaxrl.models.attention.flash import block_visibility, flash_attention
from jaxrl.train.forward import micro_batch_logprobs

H, DH = 4, 8


def _rule(q_seg, kv_seg, q_pos, kv_pos, q_par) -> np.ndarray:
    """The visibility rule with parents, in numpy: bool [B, T, L]."""
    q_seg, kv_seg, q_pos, kv_pos, q_par = (
        np.asarray(x)[..., None] if i in (0, 2, 4) else np.asarray(x)[:, None, :]
        for i, x in enumerate((q_seg, kv_seg, q_pos, kv_pos, q_par))
    )
    same = (q_seg == kv_seg) | ((q_par != 0) & (q_par == kv_seg))
    return same & (q_seg != 0) & (kv_pos <= q_pos)


def _numpy_attention(q, k, v, vis) -> np.ndarray:
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    g = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    s = np.einsum("bthd,blhd->bhtl", q, k) / np.sqrt(q.shape[-1])
    s = np.where(vis[:, None], s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True)
    p = np.where(vis[:, None], np.exp(s - np.where(np.isfinite(m), m, 0)), 0)
    denom = p.sum(-1, keepdims=True)
    return np.einsum("bhtl,blhd->bthd", p / np.where(denom > 0, denom, 1), v)


def _shared_row(groups, t, pad_between=0):
    """``(segment, position, parent)`` int32 [t] of shared-prompt groups, given as
    ``(prompt_len, [completion_len, ...])``; ``pad_between`` padding tokens after each group,
    the row's rest is padding. A completion segment is ``[p[-1], c...]`` (1 + len tokens)."""
    seg, pos, par = (np.zeros(t, np.int32) for _ in range(3))
    at, sid = 0, 0
    for prompt, completions in groups:
        sid += 1
        a = sid
        seg[at : at + prompt - 1], pos[at : at + prompt - 1] = a, np.arange(prompt - 1)
        at += prompt - 1
        for c in completions:
            sid += 1
            seg[at : at + c + 1], par[at : at + c + 1] = sid, a
            pos[at : at + c + 1] = np.arange(prompt - 1, prompt + c)
            at += c + 1
        at += pad_between
    assert at <= t, (at, t)
    return seg, pos, par


def _layouts():
    """Three rows of 64: two groups with padding between and after; a random layout (ids and
    parents out of order, positions arbitrary); one group filling the row but for 3 tokens."""
    rng = np.random.default_rng(0)
    rows = [_shared_row([(9, [5, 3, 6]), (7, [4, 8])], 64, pad_between=3)]
    seg = rng.integers(0, 5, 64).astype(np.int32)
    rows.append((seg, rng.integers(0, 20, 64).astype(np.int32), rng.integers(0, 5, 64)))
    rows.append(_shared_row([(20, [12, 14, 11])], 64))
    seg, pos, par = (jnp.asarray(np.stack([r[i] for r in rows]).astype(np.int32)) for i in range(3))
    return seg, pos, par


def _qkv(kv_heads, seed=1, t=64):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(3, t, H, DH)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(3, t, kv_heads, DH)), jnp.float32) for _ in range(2))
    return q, k, v, jnp.asarray(rng.normal(size=q.shape), jnp.float32)


def test_dense_rule_with_parents_matches_float64_and_none_is_unchanged():
    seg, pos, par = _layouts()
    q, k, v, _ = _qkv(kv_heads=2)
    out = np.asarray(attention(q, k, v, seg, seg, pos, pos, q_parent_BT=par))
    want = _numpy_attention(q, k, v, _rule(seg, seg, pos, pos, par))
    np.testing.assert_allclose(out, want, atol=1e-5)
    assert (out[np.asarray(seg) == 0] == 0).all()
    # all-zero parents: bit for bit the rule without parents
    plain = np.asarray(attention(q, k, v, seg, seg, pos, pos))
    zero = np.asarray(attention(q, k, v, seg, seg, pos, pos, q_parent_BT=jnp.zeros_like(par)))
    np.testing.assert_array_equal(zero, plain)
    assert np.abs(out - plain).max() > 1e-2  # the parents matter in these rows


def _grads(fn, q, k, v, ct, args, par):
    def loss(q, k, v):
        out = fn(q, k, v, *args, q_parent_BT=par)
        return jnp.sum(out * ct), out

    (_, out), g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return np.asarray(out), [np.asarray(x) for x in g]


@pytest.mark.parametrize(("kv_heads", "block"), [(2, 8), (1, 16), (4, 24)])
def test_flash_with_parents_equals_dense_forward_and_backward(kv_heads, block):
    seg, pos, par = _layouts()
    q, k, v, ct = _qkv(kv_heads, seed=kv_heads)
    args = (seg, seg, pos, pos)
    want, want_g = _grads(attention, q, k, v, ct, args, par)

    def flash(*a, **kw):
        return flash_attention(*a, block_size=block, **kw)

    got, got_g = _grads(flash, q, k, v, ct, args, par)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    for name, g, w in zip("qkv", got_g, want_g, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5, err_msg=f"d{name}")


def test_pallas_entry_points_with_parents_run_flash():
    """splash / pallas_gpu (interpret mode) take parents and answer the rule (via flash)."""
    seg, pos, par = _layouts()
    q, k, v, _ = _qkv(kv_heads=2)
    want = attention(q, k, v, seg, seg, pos, pos, q_parent_BT=par)
    impls = ("splash", "pallas_gpu")
    fns = [attention_fn(impl, interpret=True, block_size=16) for impl in impls]
    outs = jax.jit(lambda *a: [fn(*a, q_parent_BT=par) for fn in fns])(q, k, v, seg, seg, pos, pos)
    for impl, got in zip(impls, outs, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5, err_msg=impl)


def _exact_blocks(vis, bq, bk):
    b, t, length = vis.shape
    return vis.reshape(b, t // bq, bq, length // bk, bk).any(axis=(2, 4))


def test_block_visibility_with_parents_is_a_superset_and_exact_for_shared_rows():
    visibility = jax.jit(block_visibility, static_argnames=("block_q", "block_kv"))
    rng = np.random.default_rng(2)
    for _ in range(6):  # arbitrary layouts: never drops a visible pair
        seg = rng.integers(0, 6, (2, 48)).astype(np.int32)
        kv_seg = rng.integers(-1, 6, (2, 64)).astype(np.int32)
        q_pos, kv_pos = rng.integers(0, 30, (2, 48)), rng.integers(0, 30, (2, 64))
        par = np.where(rng.random((2, 48)) < 0.5, rng.integers(0, 6, (2, 48)), 0)
        vis = visibility(seg, kv_seg, q_pos, kv_pos, block_q=8, block_kv=16, q_parent_BT=par)
        exact = _exact_blocks(_rule(seg, kv_seg, q_pos, kv_pos, par), 8, 16)
        assert (np.asarray(vis) | ~exact).all()
    # the shared layout (issue 34's shape, scaled: prompts 35, G=4 completions of 9): exact
    groups = [(35, [9, 9, 9, 9]), (35, [9, 9, 9, 9])]
    seg, pos, par = (x[None] for x in _shared_row(groups, 160))
    for block in (8, 16, 32):
        vis = np.asarray(
            visibility(seg, seg, pos, pos, block_q=block, block_kv=block, q_parent_BT=par)
        )
        np.testing.assert_array_equal(
            vis, _exact_blocks(_rule(seg, seg, pos, pos, par), block, block), err_msg=str(block)
        )


# --- the model: a shared row gives the unshared rows' log-probs and gradients -----------------

V = 61
PROMPTS = ([5, 17, 3, 44, 9, 21, 30, 8, 12], [7, 2, 50, 33, 11, 6, 40])
COMPLETIONS = ([[13, 4, 55, 19, 2], [60, 1, 27], [8, 8, 36, 45, 10, 3]], [[14, 22, 5, 9], [1, 2]])


def _row(docs, t):
    """A micro-batch row from ``docs`` = [(tokens, positions, segment, parent, weights)]."""
    fields = {n: np.zeros(t, d) for n, d in _FIELDS}
    at = 0
    for tokens, positions, seg, par, weights in docs:
        n = len(tokens)
        fields["tokens"][at : at + n] = tokens
        fields["targets"][at : at + n - 1] = tokens[1:]
        fields["positions"][at : at + n] = positions
        fields["segment_ids"][at : at + n] = seg
        fields["parent_ids"][at : at + n] = par
        fields["weights"][at : at + n] = weights
        at += n
    return fields


_FIELDS = [
    ("tokens", np.int32),
    ("targets", np.int32),
    ("positions", np.int32),
    ("segment_ids", np.int32),
    ("parent_ids", np.int32),
    ("weights", np.float32),
]


def _batches(t_unshared=96, t_shared=64):
    """The two groups unshared (``[p c]`` documents, packed normally) and shared (one row)."""
    rng = np.random.default_rng(3)
    unshared, shared, sid = [], [], 0
    for g, (p, cs) in enumerate(zip(PROMPTS, COMPLETIONS, strict=True)):
        a = sid = sid + 1
        shared.append((p[:-1], np.arange(len(p) - 1), a, 0, np.zeros(len(p) - 1)))
        for c in cs:
            w = rng.normal(size=len(c)).astype(np.float32)  # weight of predicting c[j]
            doc = p + c
            wu = np.zeros(len(doc))
            wu[len(p) - 1 : len(doc) - 1] = w
            unshared.append((doc, np.arange(len(doc)), len(unshared) + 1, 0, wu))
            sid += 1
            ws = np.zeros(len(c) + 1)
            ws[: len(c)] = w
            shared.append(([p[-1], *c], np.arange(len(p) - 1, len(doc)), sid, a, ws))
        del g
    rows_u = [_row(unshared[:3], t_unshared // 2), _row(unshared[3:], t_unshared // 2)]
    mb_u = {n: jnp.asarray(np.stack([r[n] for r in rows_u])) for n, _ in _FIELDS}
    mb_s = {n: jnp.asarray(_row(shared, t_shared)[n][None]) for n, _ in _FIELDS}
    return mb_u, mb_s


def _completion_logps(mb, logp):
    """The log-probs at weighted positions, in document order."""
    w = np.asarray(mb["weights"]).reshape(-1)
    return np.asarray(logp).reshape(-1)[w != 0]


@pytest.fixture(scope="module")
def shipped_model():
    """Tiny, fp32, the shipped stack shape: scanned layers with block remat."""
    config = ModelConfig.tiny(
        V,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        scan_layers=True,
        remat="block",
        attention_impl="xla",
    )
    return Transformer(config, rngs=nnx.Rngs(0))


def _value_and_grads(model, mb, use_parents):
    graphdef, state = nnx.split(model)
    mb = dict(mb)
    if not use_parents:
        mb.pop("parent_ids")

    @jax.jit
    def run(state, mb):
        def loss(state):
            logp, _ = micro_batch_logprobs(nnx.merge(graphdef, state), mb)
            return jnp.sum(logp * mb["weights"]), logp

        return jax.value_and_grad(loss, has_aux=True)(state)

    (_, logp), grads = run(state, mb)
    return np.asarray(logp), [np.asarray(g) for g in jax.tree.leaves(grads)]


@pytest.mark.parametrize("impl", ["xla", "flash"])
def test_shared_row_gives_the_unshared_logprobs_and_gradients(shipped_model, impl):
    import dataclasses

    graphdef, state = nnx.split(shipped_model)
    config = dataclasses.replace(shipped_model.config, attention_impl=impl, attention_block_size=8)
    model = Transformer(config, rngs=nnx.Rngs(0))
    nnx.update(model, state)
    mb_u, mb_s = _batches()
    logp_u, grads_u = _value_and_grads(model, mb_u, use_parents=False)
    logp_s, grads_s = _value_and_grads(model, mb_s, use_parents=True)
    np.testing.assert_allclose(
        _completion_logps(mb_s, logp_s), _completion_logps(mb_u, logp_u), rtol=1e-5, atol=1e-6
    )
    for gs, gu in zip(grads_s, grads_u, strict=True):
        np.testing.assert_allclose(gs, gu, rtol=1e-5, atol=1e-5 * np.abs(gu).max())


def test_moe_routed_forward_takes_parents():
    """The MoE stack (``routed_hidden_states``, scanned) passes parents down like the dense one."""
    config = ModelConfig.tiny(
        V,
        model_type="qwen3_moe",
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_experts=4,
        num_experts_per_tok=2,
        scan_layers=True,
    )
    model = Transformer(config, rngs=nnx.Rngs(1))
    _, mb = _batches()
    args = (mb["tokens"], mb["positions"], mb["segment_ids"])

    @nnx.jit
    def run(model, parents):
        routed, _ = model.routed_hidden_states(*args, parent_ids=parents)
        return routed, model.hidden_states(*args, parent_ids=parents)

    routed, plain = run(model, mb["parent_ids"])
    np.testing.assert_allclose(routed, plain, atol=1e-6)
    without, _ = run(model, None)
    assert np.abs(np.asarray(routed) - np.asarray(without)).max() > 1e-3
