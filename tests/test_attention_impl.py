"""``model.attention_impl``: every implementation equals the dense reference, flash skips work.

The dense ``xla`` reference is itself checked against a float64 numpy evaluation of the
visibility rule; ``flash`` runs natively, the Pallas kernels (``splash``, ``pallas_gpu``) in
interpret mode on CPU.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.cli import main
from jaxrl.config import ConfigError, ModelSection, from_dict
from jaxrl.generate.dense_decode import decode_step, left_pad, prefill
from jaxrl.models import ModelConfig, Transformer, save_pretrained
from jaxrl.models.attention.dense import attention, positions_from_segments
from jaxrl.models.attention.dispatch import attention_fn, resolve_attention_impl
from jaxrl.models.attention.flash import block_visibility, flash_attention
from jaxrl.models.attention.pallas import index_causal_matches
from jaxrl.train.run_io.metrics import read_metrics

H, DH, T, BLOCK = 4, 8, 40, 16  # T is not a multiple of BLOCK (nor of the Pallas blocks)


def _segments() -> np.ndarray:
    """Three rows of T: documents 7/13/13 + 7 padding; one document + 5 padding; all padding."""
    seg = np.zeros((3, T), np.int32)
    seg[0, :7], seg[0, 7:20], seg[0, 20:33] = 1, 2, 3
    seg[1, :35] = 1
    return seg


def _inputs(kv_heads: int, dtype=jnp.float32, seed: int = 0):
    rng = np.random.default_rng(seed)
    b = 3
    q = jnp.asarray(rng.normal(size=(b, T, H, DH)), dtype)
    k, v = (jnp.asarray(rng.normal(size=(b, T, kv_heads, DH)), dtype) for _ in range(2))
    ct = jnp.asarray(rng.normal(size=(b, T, H, DH)), jnp.float32)
    seg = jnp.asarray(_segments())
    return q, k, v, ct, seg, positions_from_segments(seg)


def _numpy_reference(q, k, v, q_seg, kv_seg, q_pos, kv_pos) -> np.ndarray:
    """float64 evaluation of the rule: same document, not padding, kv_pos <= q_pos."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    q_seg, kv_seg, q_pos, kv_pos = (np.asarray(x) for x in (q_seg, kv_seg, q_pos, kv_pos))
    g = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    s = np.einsum("bthd,blhd->bhtl", q, k) / np.sqrt(q.shape[-1])
    vis = (
        (q_seg[:, :, None] == kv_seg[:, None, :])
        & (q_seg[:, :, None] != 0)
        & (kv_pos[:, None, :] <= q_pos[:, :, None])
    )[:, None]
    s = np.where(vis, s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True)
    p = np.where(vis, np.exp(s - np.where(np.isfinite(m), m, 0)), 0)
    denom = p.sum(-1, keepdims=True)
    p = p / np.where(denom > 0, denom, 1)
    return np.einsum("bhtl,blhd->bthd", p, v)


def _impl(name: str):
    if name == "xla":
        return attention
    if name == "flash":
        return lambda *a: flash_attention(*a, block_size=BLOCK)
    return attention_fn(name, interpret=True, block_size=BLOCK)


def _value_and_grads(fn, q, k, v, ct, seg, pos):
    def loss(q, k, v):
        out = fn(q, k, v, seg, seg, pos, pos)
        return jnp.sum(out.astype(jnp.float32) * ct), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return np.asarray(out, np.float32), [np.asarray(g, np.float32) for g in grads]


def test_xla_reference_matches_float64_rule_and_zeroes_padding():
    q, k, v, _, seg, pos = _inputs(kv_heads=2)
    out = np.asarray(attention(q, k, v, seg, seg, pos, pos))
    np.testing.assert_allclose(out, _numpy_reference(q, k, v, seg, seg, pos, pos), atol=1e-5)
    assert (out[np.asarray(seg) == 0] == 0).all()  # padding sees nothing
    assert np.abs(out[np.asarray(seg) > 0]).min() > 0


CASES = [
    ("flash", 2, "float32"),
    ("flash", 1, "float32"),
    ("flash", 4, "float32"),
    ("flash", 2, "bfloat16"),
    ("splash", 2, "float32"),
    ("splash", 1, "float32"),
    ("splash", 2, "bfloat16"),
    ("pallas_gpu", 2, "float32"),
    ("pallas_gpu", 1, "float32"),
    ("pallas_gpu", 2, "bfloat16"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("impl", "kv_heads", "dtype"), CASES)
def test_impl_equals_xla_forward_and_backward(impl, kv_heads, dtype):
    """Packed documents + trailing padding, a one-document row and an all-padding row."""
    q, k, v, ct, seg, pos = _inputs(kv_heads, jnp.dtype(dtype))
    want, want_grads = _value_and_grads(attention, q, k, v, ct, seg, pos)
    got, got_grads = _value_and_grads(_impl(impl), q, k, v, ct, seg, pos)
    tol = 1e-5 if dtype == "float32" else 3e-2
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)
    for name, g, w in zip("qkv", got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, atol=tol, rtol=tol, err_msg=f"d{name}")
    padding = np.asarray(seg) == 0
    assert (got[padding] == 0).all() and (got_grads[0][padding] == 0).all()
    assert (got[2] == 0).all() and all((g[2] == 0).all() for g in got_grads)  # all padding


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["splash", "pallas_gpu"])
def test_pallas_kernels_take_the_score_variants(impl):
    """Interpret mode, forward and backward, against xla with the same variants: both kernels
    take Gemma's score scale; splash also the soft-cap and a sliding window (its LocalMask, by
    index; with positions that skip, the fallback test sends the call to dense). pallas_gpu's
    soft-capped or windowed calls go to flash (checked against xla in tests/test_gemma.py)."""
    q, k, v, ct, seg, pos = _inputs(2)
    variant = dict(scale=0.3) if impl == "pallas_gpu" else dict(scale=0.3, softcap=1.5, window=5)
    with_variant = lambda fn: lambda *a: fn(*a, **variant)  # noqa: E731
    want, want_grads = _value_and_grads(with_variant(attention), q, k, v, ct, seg, pos)
    got, got_grads = _value_and_grads(with_variant(_impl(impl)), q, k, v, ct, seg, pos)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    for g, w in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5)
    plain, _ = _value_and_grads(attention, q, k, v, ct, seg, pos)
    assert np.abs(plain - want).max() > 1e-2
    if impl == "splash":  # positions 0, 2, 4, ...: the index window is not the position one,
        # so a windowed call takes the dense fallback (a plain causal one keeps the kernel)
        assert index_causal_matches(seg, seg, pos, pos, consecutive=True)
        assert not index_causal_matches(seg, seg, pos * 2, pos * 2, consecutive=True)
        assert index_causal_matches(seg, seg, pos * 2, pos * 2)


def test_flash_with_a_longer_cache_equals_xla():
    """The KV-cache shape: 3 queries against 50 slots, left padding and unwritten slots."""
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.normal(size=(2, 3, H, DH)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(2, 50, 2, DH)), jnp.float32) for _ in range(2))
    kv_seg = np.full((2, 50), -1, np.int32)
    kv_seg[0, :5], kv_seg[0, 5:33] = 0, 1  # 5 left-padding slots, 28 prompt + written slots
    kv_seg[1, :33] = 1
    kv_pos = np.zeros((2, 50), np.int32)
    kv_pos[0, 5:33], kv_pos[1, :33] = np.arange(28), np.arange(33)
    q_seg = np.array([[1, 1, 1], [2, 1, 1]], np.int32)  # row 1's first query sees nothing
    q_pos = np.array([[25, 26, 27], [30, 31, 32]], np.int32)
    args = tuple(jnp.asarray(x) for x in (q_seg, kv_seg, q_pos, kv_pos))
    ct = jnp.asarray(rng.normal(size=q.shape), jnp.float32)

    def grads(fn):
        return jax.grad(lambda *a: jnp.sum(fn(*a, *args) * ct), argnums=(0, 1, 2))(q, k, v)

    flash = jax.jit(lambda *a: flash_attention(*a, block_size=BLOCK))
    out = flash(q, k, v, *args)
    np.testing.assert_allclose(out, attention(q, k, v, *args), atol=1e-5)
    np.testing.assert_allclose(out, _numpy_reference(q, k, v, *args), atol=1e-5)
    assert (np.asarray(out[1, 0]) == 0).all()
    for g, w in zip(grads(flash), grads(attention), strict=True):
        np.testing.assert_allclose(g, w, atol=1e-5)


@pytest.mark.slow
def test_flash_never_touches_invisible_blocks():
    """NaN in every padding block's q, k and v: a visited block would spread it (0 * NaN)."""
    t = 6 * BLOCK
    seg = np.zeros((1, t), np.int32)
    seg[0, : 2 * BLOCK + 5] = 1  # 2 full blocks + 5 tokens of one document, then padding
    seg_j = jnp.asarray(seg)
    pos = positions_from_segments(seg_j)
    rng = np.random.default_rng(4)
    q = rng.normal(size=(1, t, H, DH)).astype(np.float32)
    k, v = (rng.normal(size=(1, t, 2, DH)).astype(np.float32) for _ in range(2))
    clean = [jnp.asarray(x) for x in (q, k, v)]
    for x in (q, k, v):
        x[:, 3 * BLOCK :] = np.nan  # the three all-padding blocks
    poisoned = [jnp.asarray(x) for x in (q, k, v)]

    def loss(q, k, v):
        out = flash_attention(q, k, v, seg_j, seg_j, pos, pos, block_size=BLOCK)
        return jnp.sum(out * (seg_j > 0)[:, :, None, None]), out

    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(*poisoned)
    want = attention(*clean, seg_j, seg_j, pos, pos)
    real = seg[0] > 0
    np.testing.assert_allclose(np.asarray(out)[0, real], np.asarray(want)[0, real], atol=1e-5)
    assert all(np.isfinite(np.asarray(g)[0, :, ...][real]).all() for g in grads)


def _exact_blocks(q_seg, kv_seg, q_pos, kv_pos, bq, bk) -> np.ndarray:
    """Token-level mask reduced to blocks: does the pair hold any visible entry?"""
    vis = (
        (q_seg[:, :, None] == kv_seg[:, None, :])
        & (q_seg[:, :, None] != 0)
        & (kv_pos[:, None, :] <= q_pos[:, :, None])
    )
    b, t, length = vis.shape
    return vis.reshape(b, t // bq, bq, length // bk, bk).any(axis=(2, 4))


def _packed(lengths, t) -> np.ndarray:
    seg, at = np.zeros((1, t), np.int32), 0
    for i, n in enumerate(lengths, start=1):
        seg[0, at : at + n], at = i, at + n
    return seg


def _blocks_per_document(lengths, block) -> int:
    """sum over documents of the causal block pairs its own tokens span."""
    total, at = 0, 0
    for n in lengths:
        first, last = at // block, (at + n - 1) // block
        nb = last - first + 1
        total += nb * (nb + 1) // 2
        at += n
    return total


def test_visited_blocks_track_per_document_work_not_row_length():
    t, block = 1024, 64
    rng = np.random.default_rng(5)
    short = [int(n) for n in rng.integers(9, 18, 60)]  # ~780 tokens of short documents
    layouts = {"one long document": [t], "many short documents": short, "one short": [100]}
    counts = {}
    for name, lengths in layouts.items():
        seg = _packed(lengths, t)
        pos = np.asarray(positions_from_segments(jnp.asarray(seg)))
        vis = np.asarray(block_visibility(seg, seg, pos, pos, block_q=block, block_kv=block))
        exact = _exact_blocks(seg, seg, pos, pos, block, block)
        np.testing.assert_array_equal(vis, exact, err_msg=name)  # exact for packed rows
        counts[name] = int(vis.sum())
        assert counts[name] <= _blocks_per_document(lengths, block), name
    nb = t // block
    assert counts["one long document"] == nb * (nb + 1) // 2 == 136
    # 60 short documents fill 13 blocks: the diagonal plus one block per boundary crossing
    assert counts["many short documents"] <= 2 * 13
    assert counts["one short"] == 3  # two blocks: (0,0), (1,0), (1,1); padding costs nothing


def test_block_visibility_never_drops_a_visible_pair():
    """Any layout (ids out of order, documents split, arbitrary positions): a superset."""
    rng = np.random.default_rng(6)
    flash = jax.jit(lambda *a: flash_attention(*a, block_size=16))
    for _ in range(8):
        seg = rng.integers(0, 4, (2, 48)).astype(np.int32)
        kv_seg = np.where(rng.random((2, 64)) < 0.2, -1, rng.integers(0, 4, (2, 64))).astype(
            np.int32
        )
        q_pos = rng.integers(0, 30, (2, 48)).astype(np.int32)
        kv_pos = rng.integers(0, 30, (2, 64)).astype(np.int32)
        vis = np.asarray(block_visibility(seg, kv_seg, q_pos, kv_pos, block_q=8, block_kv=16))
        exact = _exact_blocks(seg, kv_seg, q_pos, kv_pos, 8, 16)
        assert (vis | ~exact).all()
        q = jnp.asarray(rng.normal(size=(2, 48, H, DH)), jnp.float32)
        k, v = (jnp.asarray(rng.normal(size=(2, 64, 2, DH)), jnp.float32) for _ in range(2))
        args = tuple(jnp.asarray(x) for x in (seg, kv_seg, q_pos, kv_pos))
        np.testing.assert_allclose(flash(q, k, v, *args), attention(q, k, v, *args), atol=1e-5)


def test_index_causal_condition_and_fallback():
    seg = jnp.asarray(_segments())
    pos = positions_from_segments(seg)
    assert bool(index_causal_matches(seg, seg, pos, pos))  # packer layout
    left, left_pos = jnp.asarray([[0, 0, 1, 1, 1]]), jnp.asarray([[0, 0, 0, 1, 2]])  # sampler
    assert bool(index_causal_matches(left, left, left_pos, left_pos))
    assert not bool(index_causal_matches(left, left, left_pos, left_pos + 1))  # not self
    split = jnp.asarray([[1, 1, 2, 2, 1, 1]])  # document 1 resumes after document 2
    split_pos = positions_from_segments(split)
    assert not bool(index_causal_matches(split, split, split_pos, split_pos))
    back = jnp.asarray([[0, 1, 2, 0, 0]])  # positions must increase within a document
    assert not bool(index_causal_matches(seg[:1, :5], seg[:1, :5], back, back))
    # a layout that breaks the condition still gives the rule's answer (dense fallback)
    rng = np.random.default_rng(7)
    q, k, v = (jnp.asarray(rng.normal(size=(1, 6, H, DH)), jnp.float32) for _ in range(3))
    for impl in ("splash", "pallas_gpu"):
        got = _impl(impl)(q, k, v, split, split, split_pos, split_pos)
        np.testing.assert_allclose(got, attention(q, k, v, split, split, split_pos, split_pos))


def test_choices_resolve_per_backend_and_unavailable_ones_are_errors():
    assert resolve_attention_impl("auto", "tpu") == "splash"
    assert resolve_attention_impl("auto", "gpu") == "pallas_gpu"
    assert resolve_attention_impl("auto", "cpu") == "flash"
    assert resolve_attention_impl("flash", "tpu") == "flash"
    with pytest.raises(ValueError, match=r"model.attention_impl='splash' needs a TPU.*'cpu'"):
        resolve_attention_impl("splash", "cpu")
    with pytest.raises(ValueError, match=r"model.attention_impl='pallas_gpu' needs a GPU"):
        resolve_attention_impl("pallas_gpu", "cpu")
    with pytest.raises(ValueError, match=r"ModelConfig.attention_impl='dense'"):
        ModelConfig.tiny(64, attention_impl="dense")
    with pytest.raises(ConfigError, match=r"model.attention_impl"):
        from_dict(ModelSection, {"attention_impl": "fast"}, where="model")
    # the KV-cache path keeps the dense reference unless flash is asked for
    assert attention_fn("auto", self_attention=False) is attention
    assert attention_fn("splash", self_attention=False, interpret=True) is attention


def _model(impl: str) -> Transformer:
    config = ModelConfig.tiny(
        97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, attention_impl=impl
    )
    return Transformer(config, rngs=nnx.Rngs(0))


@nnx.jit
def _logits_and_grad(model, ids, seg):
    def loss(m):
        logits = m(ids, segment_ids=seg)
        return jnp.sum(jax.nn.log_softmax(logits)[..., 3] * (seg > 0)), logits

    (value, logits), grads = nnx.value_and_grad(loss, has_aux=True)(model)
    return value, logits, jax.tree.leaves(nnx.state(grads))


@pytest.mark.slow
def test_transformer_with_flash_equals_xla():
    rng = np.random.default_rng(8)
    seg = jnp.asarray(np.concatenate([_segments(), _packed([150, 60], T * 6)[:, :T]]))
    ids = jnp.asarray(rng.integers(0, 97, seg.shape))
    flash, xla = _model("flash"), _model("xla")
    fv, fl, fg = _logits_and_grad(flash, ids, seg)
    xv, xl, xg = _logits_and_grad(xla, ids, seg)
    np.testing.assert_allclose(fl, xl, atol=1e-5)
    np.testing.assert_allclose(fv, xv, rtol=1e-5)
    for a, b in zip(fg, xg, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_unavailable_kernel_through_the_model_is_a_clear_error():
    with pytest.raises(ValueError, match=r"attention_impl='splash' needs a TPU"):
        _model("splash")(jnp.zeros((1, 8), jnp.int32))


@pytest.mark.parametrize("impl", ["xla", "flash", "auto"])
def test_kv_cache_decode_equals_full_forward(impl):
    model = _model(impl)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [4]]
    forced = np.random.default_rng(9).integers(1, 97, (3, 5)).astype(np.int32)
    graphdef, params = nnx.split(model)

    @jax.jit
    def cached(params, tokens_BP, lengths_B, forced_BN):
        m = nnx.merge(graphdef, params)
        first, cache = prefill(m, tokens_BP, lengths_B, tokens_BP.shape[1] + forced_BN.shape[1])
        out = [first]
        for i in range(forced_BN.shape[1]):
            logits, cache = decode_step(m, forced_BN[:, i], lengths_B + i, cache)
            out.append(logits)
        return jnp.stack(out, axis=1)

    tokens, lengths = left_pad(prompts, pad_id=0, length=8)
    got = np.asarray(cached(params, tokens, lengths, forced))
    ids, seg = np.zeros((3, 14), np.int32), np.zeros((3, 14), np.int32)
    for b, p in enumerate(prompts):
        ids[b, : len(p) + 5], seg[b, : len(p) + 5] = np.concatenate([p, forced[b]]), 1
    full = np.asarray(_model("xla")(jnp.asarray(ids), segment_ids=jnp.asarray(seg)))
    for b, p in enumerate(prompts):
        np.testing.assert_allclose(got[b], full[b, len(p) - 1 : len(p) + 5], atol=1e-5)


def test_attention_impl_is_not_written_to_config_json(tmp_path):
    save_pretrained(_model("flash"), tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    save_pretrained(_model("xla"), tmp_path / "xla")
    assert hf == json.loads((tmp_path / "xla" / "config.json").read_text())
    assert not any("attention_impl" in key or "block_size" in key for key in hf)


@pytest.mark.slow
def test_cli_flash_losses_equal_xla(tmp_path):
    def losses(impl):
        out = tmp_path / impl
        sets = [f"output_dir={out}", "max_steps=3", "logging.progress=false"]
        sets.append(f"model.attention_impl={impl}")
        args = ["train", "configs/sft_tiny.yaml"]
        for s in sets:
            args += ["--set", s]
        assert main(args) == 0
        return [r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]

    flash, xla = losses("flash"), losses("xla")
    assert len(flash) == len(xla) == 3
    np.testing.assert_allclose(flash, xla, rtol=1e-5)
