"""Transformer: logits parity with transformers (unpacked and packed), masking, modes, sharding."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_fixtures import CASES, LLAMA3_SCALING, hf_logits, write_case
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl.models import ModelConfig, Transformer, from_pretrained
from jaxrl.models.attention.dense import attention, positions_from_segments
from jaxrl.models.sharding import logical_to_spec, state_shardings
from jaxrl.runtime.mesh import make_mesh

TOL = 1e-4


def _jit(fn, model: Transformer, *args):
    """``fn(model, *args)`` under jit, model passed functionally (split/merge)."""
    graphdef, state = nnx.split(model)
    return jax.jit(lambda s, *a: fn(nnx.merge(graphdef, s), *a))(state, *args)


@functools.partial(jax.jit, static_argnums=0)
def _apply(graphdef, state, ids, positions, segment_ids):
    return nnx.merge(graphdef, state)(ids, positions, segment_ids)


def _forward(model: Transformer, ids, positions=None, segment_ids=None) -> np.ndarray:
    """Jitted logits; compiled once per (architecture, shapes), shared across models."""
    return np.asarray(_apply(*nnx.split(model), jnp.asarray(ids), positions, segment_ids))


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    path, hf_model = write_case(request.param, tmp_path_factory.mktemp("hf"))
    return request.param, hf_model, from_pretrained(path)


@pytest.mark.slow
def test_unpacked_batch_matches_transformers(case):
    name, hf_model, model = case
    ids = np.random.default_rng(1).integers(0, model.config.vocab_size, (2, 24))
    diff = np.abs(_forward(model, ids) - hf_logits(hf_model, ids)).max()
    assert diff <= TOL, f"{name}: max |logit diff| {diff:.2e}"


@pytest.mark.slow
def test_packed_row_matches_each_document(case):
    """Documents packed with segment ids and trailing padding match their unpacked logits."""
    name, hf_model, model = case
    rng = np.random.default_rng(2)
    docs = [rng.integers(0, model.config.vocab_size, n) for n in (7, 11, 4, 9)]
    rows = [[0, 1, 2], [3, 0]]  # two rows; doc 0 appears in both, at different offsets
    t = 28
    ids, seg = np.zeros((2, t), np.int32), np.zeros((2, t), np.int32)
    for r, row in enumerate(rows):
        at = 0
        for s, d in enumerate(row, start=1):
            ids[r, at : at + len(docs[d])], seg[r, at : at + len(docs[d])] = docs[d], s
            at += len(docs[d])
        ids[r, at:] = rng.integers(0, model.config.vocab_size, t - at)  # padding: any token
    logits = _forward(model, ids, segment_ids=seg)
    worst = 0.0
    for r, row in enumerate(rows):
        for s, d in enumerate(row, start=1):
            ref = hf_logits(hf_model, docs[d][None])[0]
            worst = max(worst, float(np.abs(logits[r][seg[r] == s] - ref).max()))
    assert worst <= TOL, f"{name}: max |logit diff| packed vs unpacked {worst:.2e}"
    assert np.isfinite(logits).all()


def _tiny(**overrides) -> Transformer:
    fields = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128)
    return Transformer(ModelConfig.tiny(128, **(fields | overrides)), rngs=nnx.Rngs(0))


@pytest.mark.slow
def test_padding_never_influences_real_tokens_and_stays_finite():
    model = _tiny(model_type="qwen3")
    seg = jnp.array([[1, 1, 1, 2, 2, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0, 0]])
    ids_a = jnp.array([[5, 6, 7, 8, 9, 1, 2, 3], [1, 2, 3, 4, 5, 6, 7, 8]])
    ids_b = ids_a.at[0, 5:].set(jnp.array([-7, 1000, 42])).at[1].set(99)  # incl. out-of-range

    def real_sum(m: Transformer, ids: jax.Array) -> jax.Array:
        return jnp.sum(m(ids, segment_ids=seg) * (seg > 0)[..., None])

    la, lb = _forward(model, ids_a, None, seg), _forward(model, ids_b, None, seg)
    real = np.asarray(seg > 0)
    np.testing.assert_array_equal(la[real], lb[real])
    assert np.isfinite(lb).all()
    grads = _jit(lambda m, i: nnx.state(nnx.grad(real_sum)(m, i)), model, ids_b)
    leaves = jax.tree.leaves(grads)
    assert all(np.isfinite(np.asarray(g)).all() for g in leaves)


def test_attention_with_no_visible_key_is_zero_with_finite_grads():
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(1, 3, 4, 8)), jnp.float32) for _ in range(3))
    k, v = k[:, :, :2], v[:, :, :2]
    q_seg, kv_seg = jnp.array([[1, 1, 2]]), jnp.array([[2, 2, 2]])  # queries of doc 1 see nothing
    pos = jnp.array([[0, 1, 2]])

    def f(q, k, v):
        return attention(q, k, v, q_seg, kv_seg, pos, pos)

    out = jax.jit(f)(q, k, v)
    np.testing.assert_array_equal(np.asarray(out[0, :2]), 0.0)
    assert np.abs(np.asarray(out[0, 2])).min() > 0  # the visible query is not zeroed
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 1, 2)))(q, k, v)
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)


def test_positions_restart_per_segment_and_are_the_default():
    seg = jnp.array([[1, 1, 2, 2, 2, 0, 0], [3, 3, 3, 3, 3, 3, 3]])
    expected = [[0, 1, 0, 1, 2, 0, 1], [0, 1, 2, 3, 4, 5, 6]]
    np.testing.assert_array_equal(np.asarray(positions_from_segments(seg)), expected)
    model = _tiny()
    ids = jnp.arange(14).reshape(2, 7)
    base = _forward(model, ids, None, seg)
    np.testing.assert_array_equal(base, _forward(model, ids, jnp.asarray(expected), seg))
    # RoPE is relative: a uniform shift changes nothing, stretched positions do.
    shifted = _forward(model, ids, jnp.asarray(expected) + 3, seg)
    np.testing.assert_allclose(shifted, base, atol=1e-5)
    stretched = _forward(model, ids, jnp.asarray(expected) * 2, seg)
    assert np.abs(stretched - base).max() > 1e-3


def test_tree_mode_matches_graph_mode():
    model = _tiny(tie_word_embeddings=False)
    ids = jnp.arange(16).reshape(2, 8) % 128
    with nnx.set_graph_mode(False):
        graphdef, state = nnx.split(model)
        tree = jax.jit(lambda s, i: nnx.merge(graphdef, s)(i))(state, ids)
    np.testing.assert_allclose(np.asarray(tree), _forward(model, ids), atol=1e-5, rtol=1e-5)


def test_bf16_compute_dtype_and_storage():
    ids = jnp.zeros((1, 4), jnp.int32)
    model = _tiny(param_dtype="bfloat16")
    assert model.embedding[...].dtype == jnp.bfloat16
    assert nnx.eval_shape(lambda m: m(ids), model).dtype == jnp.bfloat16
    mixed = _tiny(dtype="bfloat16")  # fp32 storage, bf16 compute
    assert mixed.embedding[...].dtype == jnp.float32
    assert nnx.eval_shape(lambda m: m.hidden_states(ids), mixed).dtype == jnp.bfloat16
    assert nnx.eval_shape(lambda m: m(ids), mixed).dtype == jnp.bfloat16


@pytest.mark.slow
def test_sharding_rules_map_logical_axes_to_the_mesh():
    batch_axes = ("data", "fsdp")
    assert logical_to_spec(("batch", None, "embed")) == PartitionSpec(batch_axes, None, "fsdp")
    with pytest.raises(ValueError, match="'nope'"):
        logical_to_spec(("nope",))
    mesh = make_mesh(2, 2, 2)
    model = _tiny()
    graphdef, state = nnx.split(model)
    shardings = state_shardings(state, mesh)
    spec = lambda v: v.get_value().spec  # noqa: E731
    # [vocab, vocab_embed]: vocabulary-parallel over fsdp × tensor, never split over its width
    assert spec(shardings["embedding"]) == PartitionSpec(("fsdp", "tensor"), None)
    attn = shardings["layers"][0]["attn"]
    assert spec(attn["q_kernel"]) == PartitionSpec("fsdp", "tensor", None)
    assert spec(attn["o_kernel"]) == PartitionSpec("tensor", None, "fsdp")
    assert spec(shardings["layers"][0]["mlp"]["down_kernel"]) == PartitionSpec("tensor", "fsdp")
    # A dimension the axis does not divide stays whole: 2 KV heads on tensor=8.
    wide = state_shardings(state, make_mesh(1, 1, 8))
    assert spec(wide["layers"][0]["attn"]["k_kernel"]) == PartitionSpec(None, None, None)
    assert spec(wide["layers"][0]["attn"]["q_kernel"]) == PartitionSpec(None, None, None)  # 4
    # Axes of size 1 are dropped: a pure data mesh replicates every parameter.
    flat = jax.tree.leaves(state_shardings(state, make_mesh(8)))
    assert all(s.is_fully_replicated for s in flat)
    # Sharded forward: params over fsdp/tensor, batch over data × fsdp, same logits.
    ids = jnp.arange(8 * 6).reshape(8, 6) % 128
    placed = jax.device_put(state, shardings)
    assert placed["embedding"].get_value().addressable_shards[0].data.shape == (32, 64)
    batch = jax.device_put(ids, NamedSharding(mesh, logical_to_spec(("batch", None))))
    out = jax.jit(lambda s, i: nnx.merge(graphdef, s)(i))(placed, batch)
    np.testing.assert_allclose(np.asarray(out), _forward(model, ids), atol=1e-5, rtol=1e-5)


def test_config_validation_names_field_value_and_fix():
    with pytest.raises(ValueError, match=r"model_type='gpt2'.*llama"):
        ModelConfig.tiny(64, model_type="gpt2")
    with pytest.raises(ValueError, match=r"num_key_value_heads=3.*divide"):
        ModelConfig.tiny(64, num_key_value_heads=3)
    with pytest.raises(ValueError, match=r"attention_bias=False.*set attention_bias=True"):
        ModelConfig.tiny(64, model_type="qwen2", attention_bias=False)
    with pytest.raises(ValueError, match=r"dtype='fp8'"):
        ModelConfig.tiny(64, dtype="fp8")
    with pytest.raises(ValueError, match=r"rope_type"):
        ModelConfig.tiny(64, rope_scaling={"rope_type": "yarn", "factor": 2.0})
    config = ModelConfig.tiny(64, rope_scaling=LLAMA3_SCALING)
    assert config.head_dim == 32 and config.dtype == "float32"
    assert hash(config) == hash(dataclasses.replace(config))  # static under jit
