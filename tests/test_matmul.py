"""``model.matmul_dtype`` (jaxrl/models/matmul.py, docs/precision.md "Matmul operands"): bf16
operands with fp32 accumulation in the projection matmuls, forward and backward, checked against
float64 numpy on the bf16-rounded operands; the compute-dtype path is the plain matmul; the
engine's decode model keeps the bf16 operands, from a narrow copy of the kernels (the vLLM
export does not); ``auto`` resolves by backend and CPU; the trainer's micro-batched step equals
its full-batch step with bf16 operands too."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.generate.sampler_weights import decode_model, sampler_model
from jaxrl.models.matmul import PROJECTIONS, matmul
from jaxrl.models.model_config import ModelConfig
from jaxrl.train import precision


def _bf16(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32))


def _data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 5, 24)).astype(np.float32)
    w = rng.standard_normal((24, 16)).astype(np.float32) / 5
    g = rng.standard_normal((2, 5, 16)).astype(np.float32)
    return x, w, g


def test_bf16_operands_forward_and_backward_match_float64_reference():
    x, w, g = _data()
    out, vjp = jax.vjp(lambda a, b: matmul(a, b, "bfloat16"), jnp.asarray(x), jnp.asarray(w))
    dx, dw = vjp(jnp.asarray(g))
    xb, wb, gb = (_bf16(v).astype(np.float64) for v in (x, w, g))
    ref = xb @ wb
    assert out.dtype == jnp.float32 and dx.dtype == jnp.float32 and dw.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dx), gb @ wb.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        np.asarray(dw), xb.reshape(-1, 24).T @ gb.reshape(-1, 16), rtol=1e-5, atol=1e-5
    )
    # and it is not the fp32 matmul: the operands were rounded
    assert np.abs(np.asarray(out) - x.astype(np.float64) @ w).max() > 1e-4


def test_compute_dtype_operands_are_the_plain_matmul():
    x, w, _ = _data(1)
    plain = jnp.asarray(x) @ jnp.asarray(w)
    for operands in (None, "float32"):
        assert np.array_equal(np.asarray(matmul(jnp.asarray(x), jnp.asarray(w), operands)), plain)
    cfg = ModelConfig.tiny(64, dtype="float32", matmul_dtype="float32")
    assert cfg.matmul_dtype is None  # the same math as the compute dtype: one program
    with pytest.raises(ValueError, match="matmul_dtype"):
        ModelConfig.tiny(64, matmul_dtype="int8")


def test_model_forward_is_row_independent_with_bf16_operands():
    """A row's logits do not depend on the other rows of the batch (the layouts' invariances
    rest on it), and bf16 operands move the logits by bf16 rounding only."""
    from flax import nnx

    from jaxrl.models.transformer import Transformer

    cfg = ModelConfig.tiny(64, dtype="float32", matmul_dtype="bfloat16")
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    tokens = np.random.default_rng(0).integers(0, 64, (3, 12)).astype(np.int32)
    both = np.asarray(model(jnp.asarray(tokens)))
    one = np.asarray(model(jnp.asarray(tokens[1:2])))
    np.testing.assert_allclose(both[1:2], one, rtol=1e-6, atol=1e-6)
    graphdef, state = nnx.split(model)
    fp32 = nnx.merge(nnx.graphdef(Transformer(ModelConfig.tiny(64), rngs=nnx.Rngs(0))), state)
    ref = np.asarray(fp32(jnp.asarray(tokens)))
    err = np.abs(both - ref).max()
    assert 1e-6 < err < 0.05 * np.abs(ref).max(), err


def test_vllm_export_model_runs_the_compute_dtype():
    cfg = ModelConfig.tiny(64, dtype="float32", matmul_dtype="bfloat16", scan_layers=True)
    config, _, abstract = sampler_model(cfg)
    assert config.matmul_dtype is None and config.scan_layers  # the trainer's tree, exported
    assert {x.dtype for x in jax.tree.leaves(abstract)} == {jnp.dtype("float32")}


def test_decode_model_unrolled_with_narrow_projection_kernels():
    cfg = ModelConfig.tiny(64, dtype="float32", matmul_dtype="bfloat16", scan_layers=True)
    config, _, abstract = decode_model(cfg)
    assert config.matmul_dtype == "bfloat16" and not config.scan_layers
    dtypes = {jax.tree_util.keystr(p): x.dtype for p, x in jax.tree.leaves_with_path(abstract)}
    narrow = {k for k, d in dtypes.items() if d == jnp.bfloat16}
    assert narrow and all(any(name in k for name in PROJECTIONS) for k in narrow)
    assert len(narrow) == 7 * cfg.num_hidden_layers
    assert dtypes["['embedding'].value"] == jnp.float32  # norms, embedding, head: compute dtype
    assert decode_model(ModelConfig.tiny(64))[0].matmul_dtype is None


def test_auto_resolves_by_backend_and_cpu(monkeypatch):
    resolve = precision.auto_matmul_dtype
    monkeypatch.setattr(precision, "cpu_has_bf16_matmul", lambda: "avx512_bf16")
    assert resolve(None, "auto", "cpu") == "bfloat16"
    assert resolve("auto", None, "cpu") == "bfloat16"
    assert resolve(None, "float32", "cpu") is None  # a pinned dtype keeps its matmuls
    assert resolve("float32", "auto", "cpu") == "float32"  # pinned
    assert resolve(None, "auto", "gpu") is None  # bf16 compute there already
    assert "bfloat16 operands" in precision.auto_dtype_note("cpu", "bfloat16")
    monkeypatch.setattr(precision, "cpu_has_bf16_matmul", lambda: None)
    assert resolve(None, "auto", "cpu") is None
    assert "operands" not in precision.auto_dtype_note("cpu", None)


@pytest.mark.slow
def test_bf16_operand_step_agrees_across_layouts_to_rounding(tmp_path):
    """One SFT step with bf16 matmul operands on 1 rank, on 8 data-parallel ranks and with 4x
    the micro-batches: the same loss and grad norm to 1e-6 and parameters to 5e-5 (relative
    norm; fp32 compute holds 1e-6, tests/test_zero3.py). bf16 rounding turns a last-bit fp32
    difference of an operand into a bf16 ulp, as bf16 compute does (docs/precision.md). The
    fp32 step differs from it by far more: the operands really are bf16."""
    from test_zero3 import JOBS, ONE_STEP, _train

    config, sets = JOBS["sft"]
    common = [*ONE_STEP, *sets]
    layouts = {
        "data8": ["mesh.data=8", "model.matmul_dtype=bfloat16"],
        "data1": ["mesh.data=1", "model.matmul_dtype=bfloat16"],
        "data8_micro": ["mesh.data=8", "schedule.max_tokens=32", "model.matmul_dtype=bfloat16"],
        "fp32": ["mesh.data=8", "model.matmul_dtype=float32"],
    }
    runs = {name: _train(tmp_path / name, config, [*common, *m]) for name, m in layouts.items()}
    (ref_rows, ref_w) = runs["data8"]

    def rel(name):
        rows, w = runs[name]
        loss = abs(rows[0]["loss"] / ref_rows[0]["loss"] - 1)
        norm = abs(rows[0]["grad_norm"] / ref_rows[0]["grad_norm"] - 1)
        diff = max(
            np.linalg.norm(w[k].astype(np.float64) - r) / np.linalg.norm(r)
            for k, r in ((k, v.astype(np.float64)) for k, v in ref_w.items())
        )
        return loss, norm, diff

    for name in ("data1", "data8_micro"):
        loss, norm, diff = rel(name)
        assert loss <= 1e-6 and norm <= 1e-6 and diff <= 5e-5, (name, loss, norm, diff)
    assert rel("fp32")[0] > 1e-5, rel("fp32")
