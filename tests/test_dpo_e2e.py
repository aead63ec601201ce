"""DPO end to end: exact pair/token normalisation through the engine, CLI layout invariance,
metric names, step-0 values and exact resume."""

from __future__ import annotations

import math
import shutil

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.cli import main
from jaxrl.config import ConfigError, DPOConfig, load_run_config
from jaxrl.data.batching.packing import pack_micro_batches
from jaxrl.data.batching.preference import PairDocuments, pair_micro_batches
from jaxrl.models.model_config import ModelConfig
from jaxrl.models.transformer import Transformer
from jaxrl.train.accumulate import make_accumulate
from jaxrl.train.objectives import dpo_objective, on_params
from jaxrl.train.run_io.metrics import read_metrics, reproducible
from jaxrl.train.step import make_mesh
from jaxrl.trainers.dpo import DPOTrainer
from jaxrl.trainers.session import Session

BETA = 0.1
VOCAB = 23
FIELDS = ("tokens", "targets", "loss_mask", "segment_ids", "positions", "doc_sample_index")


# ------------------------------------------------------------------ exact normalisation


def _model():
    cfg = ModelConfig.tiny(
        VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    return nnx.split(Transformer(cfg, rngs=nnx.Rngs(params=1)))


def _random_pairs(n: int, seed: int = 0) -> tuple[PairDocuments, np.ndarray]:
    """Pairs with uneven prompts (1–9 tokens) and responses (1–12); random reference values."""
    rng = np.random.default_rng(seed)
    seqs, masks, lengths = [], [], np.zeros(n, np.int64)
    for p in range(n):
        prompt = rng.integers(1, VOCAB, size=int(rng.integers(1, 10)))
        for _ in range(2):
            response = rng.integers(1, VOCAB, size=int(rng.integers(1, 13)))
            seqs.append(np.concatenate([prompt, response]).astype(np.int32))
            masks.append(np.r_[np.zeros(len(prompt)), np.ones(len(response))].astype(np.float32))
            lengths[p] += len(seqs[-1])
    refs = rng.normal(-25.0, 6.0, size=2 * n).astype(np.float32)  # doc 2p: ref_c, 2p+1: ref_r
    return PairDocuments(seqs, masks, lengths), refs


def _reference(graphdef, params, docs: PairDocuments, refs: np.ndarray, normalize: str):
    """The stated objective on unpacked rows (one document per row), written independently:
    pair → mean_p ℓ_p; token → Σ T_p ℓ_p / Σ T_p; ℓ_p = log(1 + exp(−β z_p))."""
    T = max(len(s) for s in docs.sequences)
    n_docs = len(docs.sequences)
    tokens = np.zeros((n_docs, T), np.int32)
    seg = np.zeros((n_docs, T), np.int32)
    weight = np.zeros((n_docs, T), np.float32)  # weight of position t = mask of token t + 1
    for d, (s, m) in enumerate(zip(docs.sequences, docs.masks, strict=True)):
        tokens[d, : len(s)], seg[d, : len(s)] = s, 1
        weight[d, : len(s) - 1] = m[1:]
    tokens, seg, weight = jnp.asarray(tokens), jnp.asarray(seg), jnp.asarray(weight)
    tokens_p = jnp.asarray(docs.pair_lengths, jnp.float32)

    def objective(p):
        logits = nnx.merge(graphdef, p)(tokens, None, seg).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
        seq = jnp.sum(picked * weight[:, :-1], axis=-1)
        z = (seq[0::2] - seq[1::2]) - (refs[0::2] - refs[1::2])
        losses = jnp.logaddexp(0.0, -BETA * z)
        if normalize == "pair":
            return jnp.mean(losses), seq
        return jnp.sum(tokens_p * losses) / jnp.sum(tokens_p), seq

    (value, seq), grads = jax.jit(jax.value_and_grad(objective, has_aux=True))(params)
    # the objective's value again in float64 from the per-document values
    s, r = np.asarray(seq, np.float64), refs.astype(np.float64)
    losses64 = np.logaddexp(0.0, -BETA * ((s[0::2] - s[1::2]) - (r[0::2] - r[1::2])))
    w = np.ones_like(losses64) if normalize == "pair" else docs.pair_lengths.astype(np.float64)
    np.testing.assert_allclose(float(value), np.sum(w * losses64) / np.sum(w), rtol=1e-6)
    return float(value), grads


def _loss_fn(graphdef, normalize):
    """The trainer's DPO objective on parameters, as the engine calls it."""
    return on_params(dpo_objective(DPOConfig(beta=BETA, normalize=normalize)), graphdef)


def _packed(docs, refs, ids, dp, max_tokens):
    layout = pair_micro_batches(ids, docs.pair_lengths, dp_size=dp, max_tokens=max_tokens)
    packed = pack_micro_batches(
        layout,
        docs.sequences,
        loss_masks=docs.masks,
        doc_fields={"ref_logp": refs},
        row_len=max_tokens,
    )
    batch = {k: jnp.asarray(getattr(packed, k)) for k in FIELDS}
    batch["ref_logp"] = jnp.asarray(packed.doc_fields["ref_logp"])
    return packed, batch


def _max_rel(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    scale = max(float(jnp.max(jnp.abs(y))) for y in lb)
    return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(la, lb, strict=True)) / scale


@pytest.mark.slow
@pytest.mark.parametrize("normalize", ["pair", "token"])
def test_micro_batched_dp8_gradient_equals_full_batch(normalize):
    graphdef, params = _model()
    docs, refs = _random_pairs(30)
    value, ref_grads = _reference(graphdef, params, docs, refs, normalize)
    ids = np.random.default_rng(1).permutation(30)
    packed, batch = _packed(docs, refs, ids, dp=8, max_tokens=48)
    assert packed.num_micro_batches >= 2  # several micro-batches per rank, uneven pair counts
    loss_fn = _loss_fn(graphdef, normalize)
    acc = jax.jit(make_accumulate(loss_fn, make_mesh(8)))
    sums = acc(params, batch, jnp.array([0, packed.shape[1]]))
    grads = jax.tree.map(lambda g: g / sums.denominator, sums.grads)
    expected_den = 30 if normalize == "pair" else int(docs.pair_lengths.sum())
    assert float(sums.denominator) == expected_den
    np.testing.assert_allclose(float(sums.numerator / sums.denominator), value, rtol=1e-5)
    assert _max_rel(grads, ref_grads) < 1e-5

    # the 1/k scheme (each micro-batch's own mean, averaged over micro-batches) is different
    real = packed.num_docs.reshape(-1) > 0
    assert len(set((packed.num_docs.reshape(-1)[real] // 2).tolist())) > 1  # uneven pair counts
    rows = {n: v.reshape(-1, 1, v.shape[-1])[np.flatnonzero(real)] for n, v in batch.items()}

    @jax.jit
    @jax.grad
    def mean_of_means(p):
        terms = jax.vmap(lambda mb: loss_fn(p, mb))(rows)
        return jnp.mean(terms.numerator / terms.denominator)

    assert _max_rel(mean_of_means(params), ref_grads) > 1e-2


# ------------------------------------------------------------------ the CLI run

CONFIG = "configs/dpo_tiny.yaml"
SMALL = [
    "logging.progress=false",
    "max_steps=3",
    "warm_start.steps=4",
    "task.train_size=200",
    "task.eval_size=32",
    "optimizer.warmup_steps=0",  # steps 2 and 3 move the rewards well above fp32 noise
    "optimizer.learning_rate=1e-3",
]
METRICS = (
    "loss",
    "grad_norm",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracy",
    "rewards/margin",
    "logps/chosen",
    "logps/rejected",
)
COUNTS = ("num_documents", "documents_seen", "num_tokens")


def _train(out, *overrides):
    args = ["train", CONFIG, "--set", f"output_dir={out}"]
    for o in (*SMALL, *overrides):
        args += ["--set", o]
    assert main(args) == 0
    return read_metrics(out / "metrics.jsonl")


@pytest.fixture(scope="module")
def dp1_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("dpo") / "dp1"
    return out, _train(out, "mesh.data=1", "dpo.per_device_train_batch_size=8")


@pytest.mark.slow
def test_metric_rows_and_step_zero_values(dp1_run):
    out, rows = dp1_run
    start = rows[0]  # the held-out evaluation of the starting (reference) model
    assert start["step"] == 0
    assert set(start) == {"step", "eval/accuracy", "eval/policy_accuracy", "eval/exact_match"}
    assert start["eval/accuracy"] == 0.0  # z = 0 for every pair, and ties count as wrong
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        assert set(METRICS) <= r.keys() and r["num_documents"] == 16  # 8 pairs
        assert r["rewards/margin"] == pytest.approx(
            r["rewards/chosen"] - r["rewards/rejected"], abs=1e-6
        )
        assert r["denominator"] == 8  # pair normalisation: the step's pair count
    assert steps[0]["learning_rate"] == pytest.approx(1e-3)  # optimizer's: DPO's stage
    sft_rows = read_metrics(out / "sft" / "metrics.jsonl")
    sft_peak = load_run_config(CONFIG).warm_start.learning_rate  # the warm start's own peak
    assert sft_peak != 1e-3 and sft_rows[0]["learning_rate"] == pytest.approx(sft_peak)
    first = steps[0]  # evaluated at the reference parameters
    assert first["loss"] == pytest.approx(math.log(2), rel=1e-5)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margin"):
        assert abs(first[name]) < 1e-5
    assert steps[-1]["eval/accuracy"] == 0.5  # measured: 4 of the 8 held-out pairs
    assert (out / "hf" / "config.json").is_file() and (out / "sft" / "hf").is_dir()
    assert len(list((out / "ref_cache").glob("*.npz"))) == 2  # train and held-out


@pytest.mark.slow
def test_dp1_equals_dp8_with_other_rows(dp1_run, tmp_path):
    dp1_out, one = dp1_run
    # the same SFT start (SFT's own layout invariance is tests/test_sft_e2e.py's job)
    shutil.copytree(dp1_out / "sft" / "hf", tmp_path / "dp8" / "sft" / "hf")
    eight = _train(
        tmp_path / "dp8",
        "mesh.data=8",
        "schedule.max_tokens=24",
        "dpo.per_device_train_batch_size=1",
    )
    one, eight = [r for r in one if "loss" in r], [r for r in eight if "loss" in r]
    assert len(one) == len(eight) == 3
    for a, b in zip(one, eight, strict=True):
        assert a["num_micro_batches"] < b["num_micro_batches"]  # genuinely different layouts
        for key in METRICS:
            if key == "rewards/accuracy" and a["step"] == 1:
                # at the reference r_c − r_r is fp32 noise (~1e-7), below the margin tolerance
                assert a[key] == b[key] == 0.0
                continue
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
        for key in COUNTS:
            assert a[key] == b[key]


class _Crash(Exception):
    pass


@pytest.mark.slow
def test_interrupted_run_resumes_to_identical_metrics(dp1_run, tmp_path, monkeypatch):
    monkeypatch.setenv("JAXRL_DEBUG", "1")  # the injected crash propagates out of main
    dp1_out, straight = dp1_run
    out = tmp_path / "resumed"
    shutil.copytree(dp1_out / "sft" / "hf", out / "sft" / "hf")  # the same (deterministic) SFT
    settings = ["mesh.data=1", "dpo.per_device_train_batch_size=8", "checkpoint.every=1"]
    original = Session.run_step

    def crashing(self, arrays, expected_documents, **kwargs):
        if self.step == 2 and self.output_dir.name != "sft":
            raise _Crash
        return original(self, arrays, expected_documents, **kwargs)

    monkeypatch.setattr(Session, "run_step", crashing)
    with pytest.raises(_Crash):
        _train(out, *settings)
    monkeypatch.setattr(Session, "run_step", original)
    caches = sorted((out / "ref_cache").glob("*.npz"))
    stamps = [p.stat().st_mtime_ns for p in caches]
    resumed = _train(out, *settings)
    assert [p.stat().st_mtime_ns for p in caches] == stamps  # caches reused, not rebuilt
    assert [reproducible(r) for r in resumed] == [reproducible(r) for r in straight]


@pytest.mark.parametrize(
    "override, message",
    [
        ("schedule.docs_per_step=16", "docs_per_step=16 is not supported for DPO"),
        ("dpo.precompute_ref_log_probs=false", "precompute_ref_log_probs=false"),
    ],
)
def test_unsupported_settings_raise(tmp_path, override, message):
    cfg = load_run_config(CONFIG, [f"output_dir={tmp_path}", override])
    with pytest.raises(ConfigError, match=message):
        DPOTrainer(cfg)
