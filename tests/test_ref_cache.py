"""Reference log-prob cache (docs/algorithms/dpo.md §6, §8 case 31) and the step-0 sanity check."""

from __future__ import annotations

import dataclasses
import math
import os

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.config import DPOConfig, load_run_config
from jaxrl.data.batching.packing import pack_micro_batches
from jaxrl.data.batching.preference import pair_micro_batches
from jaxrl.data.documents import dpo_documents
from jaxrl.data.tasks import ArithmeticTask
from jaxrl.data.tokenizer import char_tokenizer
from jaxrl.models.model_config import ModelConfig
from jaxrl.models.transformer import Transformer
from jaxrl.runtime import mesh as mesh_lib
from jaxrl.train import ref_cache
from jaxrl.train.accumulate import make_accumulate
from jaxrl.train.objectives import dpo_objective, on_params
from jaxrl.train.ref_cache import (
    CacheIdentity,
    ReferenceCache,
    ReferenceCacheError,
    cache_path,
    fill_pair_logps,
    load_or_build,
)
from jaxrl.train.score import Scorer
from jaxrl.train.step import make_mesh
from jaxrl.trainers.dpo import DPOTrainer

IDENTITY = CacheIdentity(
    model="runs/x/sft/hf",
    weights="ab" * 32,
    dataset={"source": "arithmetic", "split": "train", "rows": 5},
    data="cd" * 32,
    tokenizer="ef" * 32,
    max_length=16,
    packing={"max_tokens": 256, "packing": "ffd"},
    layout={"rows": "pack_pairs"},
    loss_type="sigmoid",
    aggregation="sum",
    param_dtype="float32",
    dtype="float32",
    fp32_lm_head=False,
    logprob_chunk=0,
)


# ------------------------------------------------------------------ hashing


def test_identity_hash_is_stable_and_sensitive():
    same = dataclasses.replace(IDENTITY, dataset=dict(reversed(IDENTITY.dataset.items())))
    assert same.key == IDENTITY.key and len(IDENTITY.key) == 16
    int(IDENTITY.key, 16)
    changes = dict(
        model="other/hf",
        weights="00" * 32,
        dataset={**IDENTITY.dataset, "rows": 6},
        data="11" * 32,
        tokenizer="22" * 32,
        max_length=32,
        packing={"max_tokens": 128, "packing": "ffd"},
        layout={"pairs_per_step": 8, "ranks": 2},
        loss_type="ipo",
        aggregation="mean",
        param_dtype="bfloat16",
        dtype="bfloat16",
        fp32_lm_head=True,
        logprob_chunk=64,
    )
    keys = {IDENTITY.key}
    for field, value in changes.items():
        keys.add(dataclasses.replace(IDENTITY, **{field: value}).key)
    assert len(keys) == 1 + len(changes)  # every field changes the hash


# ------------------------------------------------------------------ rows by id


def test_rows_written_out_of_order_read_back_by_id():
    cache = ReferenceCache.empty(5, IDENTITY)
    cache.write([3, 0], [-3.0, -0.5], [-30.0, -5.0])
    cache.write([4, 1, 2], [-4.0, -1.0, -2.0], [-40.0, -10.0, -20.0])
    cache.check_complete()
    c, r = cache.lookup([2, 0, 4])
    np.testing.assert_array_equal(c, [-2.0, -0.5, -4.0])
    np.testing.assert_array_equal(r, [-20.0, -5.0, -40.0])
    assert c.dtype == np.float32
    np.testing.assert_array_equal(
        cache.document_values()[:4], [-0.5, -5.0, -1.0, -10.0]
    )  # doc 2p = chosen, 2p + 1 = rejected


def test_missing_and_unknown_rows_raise():
    cache = ReferenceCache.empty(6, IDENTITY)
    cache.write([0, 2, 5], [1.0, 2.0, 3.0], [1.0, 2.0, 3.0])
    with pytest.raises(
        ReferenceCacheError, match=r"3 of 6 rows are missing, first ids \[1, 3, 4\]"
    ):
        cache.check_complete()
    with pytest.raises(ReferenceCacheError, match=rf"{IDENTITY.key}.*first ids \[3\]"):
        cache.lookup([0, 3])
    with pytest.raises(ReferenceCacheError, match=r"row ids \[6\] are outside \[0, 6\)"):
        cache.lookup([6])
    with pytest.raises(ReferenceCacheError, match="written twice"):
        cache.write([2], [0.0], [0.0])
    with pytest.raises(ReferenceCacheError, match="missing"):
        cache.save("unused")


# ------------------------------------------------------------------ files


def _filler(calls):
    def fill(cache):
        calls.append(1)
        cache.write(np.arange(5)[::-1], -np.arange(5.0), -10 - np.arange(5.0))

    return fill


def test_hit_miss_and_atomic_file(tmp_path):
    calls = []
    built = load_or_build(tmp_path, IDENTITY, 5, _filler(calls))
    assert calls == [1] and built.path == tmp_path / f"{IDENTITY.key}.npz"
    assert os.listdir(tmp_path) == [f"{IDENTITY.key}.npz"]  # no temporary left behind
    with np.load(built.path) as f:
        assert str(f["identity"]) == IDENTITY.canonical_json()
    hit = load_or_build(tmp_path, IDENTITY, 5, _filler(calls))
    assert calls == [1]  # loaded, not rebuilt
    np.testing.assert_array_equal(hit.chosen, built.chosen)
    np.testing.assert_array_equal(hit.rejected, built.rejected)
    other = dataclasses.replace(IDENTITY, loss_type="ipo")
    load_or_build(tmp_path, other, 5, _filler(calls))
    assert calls == [1, 1]  # a different identity misses
    assert sorted(os.listdir(tmp_path)) == sorted([f"{IDENTITY.key}.npz", f"{other.key}.npz"])


def test_stray_temporary_is_never_picked_up(tmp_path):
    good = ReferenceCache.empty(5, IDENTITY)
    _filler([])(good)
    good.save(tmp_path / "elsewhere")
    # a half-written temporary (the real bytes, cut short) and a complete one both sit there
    blob = (tmp_path / "elsewhere" / f"{IDENTITY.key}.npz").read_bytes()
    (tmp_path / f".{IDENTITY.key}.x1.tmp").write_bytes(blob[: len(blob) // 2])
    (tmp_path / f".{IDENTITY.key}.x2.tmp").write_bytes(blob)
    calls = []
    load_or_build(tmp_path, IDENTITY, 5, _filler(calls))
    assert calls == [1]  # built afresh: neither temporary counts as a cache


def test_a_failed_write_leaves_no_cache(tmp_path, monkeypatch):
    def broken_savez(f, **arrays):
        f.write(b"PK\x03\x04 half")
        raise OSError("disk full")

    monkeypatch.setattr(ref_cache.np, "savez", broken_savez)
    with pytest.raises(OSError, match="disk full"):
        load_or_build(tmp_path, IDENTITY, 5, _filler([]))
    assert os.listdir(tmp_path) == []
    monkeypatch.undo()
    calls = []
    load_or_build(tmp_path, IDENTITY, 5, _filler(calls))
    assert calls == [1]


def test_a_file_for_another_identity_is_refused(tmp_path):
    other = dataclasses.replace(IDENTITY, model="other/hf")
    cache = ReferenceCache.empty(5, other)
    _filler([])(cache)
    written = cache.save(tmp_path)
    written.rename(cache_path(tmp_path, IDENTITY))  # a file under the wrong name
    with pytest.raises(ReferenceCacheError, match="another configuration"):
        load_or_build(tmp_path, IDENTITY, 5, _filler([]))


# ------------------------------------------------------------------ step-0 sanity


def _tiny_model(vocab: int) -> tuple[nnx.GraphDef, nnx.State]:
    cfg = ModelConfig.tiny(
        vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    return nnx.split(Transformer(cfg, rngs=nnx.Rngs(params=0)))


@pytest.mark.slow
def test_step_zero_policy_equals_reference():
    task = ArithmeticTask(max_digits=2, reverse_answer=True, pad_operands=True)
    tok = char_tokenizer(task.alphabet)
    docs, _, _ = dpo_documents(task.dataset("dpo", 40), tok, max_length=16)
    graphdef, params = _tiny_model(tok.vocab_size)
    scorer = Scorer(graphdef, mesh=mesh_lib.make_mesh(2, 2, 2))  # rows over 4 batch ranks
    cache = ReferenceCache.empty(40, IDENTITY)
    fill_pair_logps(scorer, params, docs, cache, max_tokens=64)
    cache.check_complete()
    assert np.all(cache.chosen < 0) and np.all(cache.chosen != cache.rejected)

    # the same forward on another packing (other rows, order and row length), on one device
    # and in calls of 4 rows, reads the same
    again = ReferenceCache.empty(40)
    fill_pair_logps(Scorer(graphdef, rows_per_call=4), params, docs, again, max_tokens=128)
    np.testing.assert_allclose(again.chosen, cache.chosen, rtol=1e-5)
    np.testing.assert_allclose(again.rejected, cache.rejected, rtol=1e-5)

    # the training loss through the engine, 8 ranks, many micro-batches, params = reference
    loss_fn = on_params(dpo_objective(DPOConfig()), graphdef)

    ids = np.random.default_rng(0).permutation(40)
    layout = pair_micro_batches(ids, docs.pair_lengths, dp_size=8, max_tokens=48)
    packed = pack_micro_batches(
        layout,
        docs.sequences,
        loss_masks=docs.masks,
        doc_fields={"ref_logp": cache.document_values()},
        row_len=48,
    )
    batch = {
        k: jnp.asarray(getattr(packed, k))
        for k in ("tokens", "targets", "loss_mask", "segment_ids", "positions", "doc_sample_index")
    }
    batch["ref_logp"] = jnp.asarray(packed.doc_fields["ref_logp"])
    assert packed.num_micro_batches > 1
    acc = jax.jit(make_accumulate(loss_fn, make_mesh(8)))
    sums = acc(params, batch, jnp.array([0, packed.shape[1]]))
    metric = {k: float(s / c) for k, (s, c) in sums.metrics.items()}
    assert float(sums.denominator) == 40
    np.testing.assert_allclose(float(sums.numerator / sums.denominator), math.log(2), rtol=1e-6)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margin"):
        assert abs(metric[name]) < 1e-6, (name, metric[name])  # β·(π − ref), π = ref to 1e-5
    np.testing.assert_allclose(metric["logps/chosen"], cache.chosen.mean(), rtol=1e-5)
    np.testing.assert_allclose(metric["logps/rejected"], cache.rejected.mean(), rtol=1e-5)


@pytest.mark.slow
def test_step_zero_accuracy_is_strictly_zero(tmp_path):
    """Where policy and reference values come from one program, every z is exactly 0."""
    cfg = load_run_config(
        "configs/dpo_tiny.yaml",
        [
            f"output_dir={tmp_path}",
            "warm_start.steps=0",
            "task.train_size=24",
            "task.eval_size=24",
            "dpo.per_device_train_batch_size=8",  # a step may not hold a pair twice
            "model.init.num_hidden_layers=1",
            "model.init.hidden_size=32",
            "model.init.intermediate_size=64",
        ],
    )
    trainer = DPOTrainer(cfg)
    trainer.build_references()
    assert trainer.evaluate()["eval/accuracy"] == 0.0  # ties are wrong
    policy = ReferenceCache.empty(24)
    trainer._pair_values(trainer.train, policy)
    ref = trainer.refs["train"]
    z = (policy.chosen - policy.rejected) - (ref.chosen - ref.rejected)
    assert np.all(z == 0.0)


def test_simpo_builds_no_cache(tmp_path):
    cfg = load_run_config(
        "configs/dpo_tiny.yaml",
        [
            f"output_dir={tmp_path}",
            "warm_start.steps=0",
            "dpo.loss_type=simpo",
            "task.train_size=16",
            "dpo.per_device_train_batch_size=8",
            "model.init.num_hidden_layers=1",
        ],
    )
    trainer = DPOTrainer(cfg)
    trainer.build_references()
    assert trainer.refs == {} and not (tmp_path / "ref_cache").exists()


# ------------------------------------------------------------------ several processes


def test_non_primary_process_loads_the_file_without_writing(tmp_path, monkeypatch):
    built = load_or_build(tmp_path, IDENTITY, 5, _filler([]))  # process 0's file
    stamp = os.stat(built.path).st_mtime_ns
    monkeypatch.setattr(ref_cache, "is_primary", lambda: False)
    saves, calls = [], []
    monkeypatch.setattr(ReferenceCache, "save", lambda self, d: saves.append(d))
    hit = load_or_build(tmp_path, IDENTITY, 5, _filler(calls))
    assert calls == [] and saves == []  # neither computed nor written
    assert os.stat(built.path).st_mtime_ns == stamp
    np.testing.assert_array_equal(hit.chosen, built.chosen)
    np.testing.assert_array_equal(hit.rejected, built.rejected)


def test_non_primary_process_fills_waits_and_names_a_missing_file(tmp_path, monkeypatch):
    """Every process takes part in the (collective) fill, only process 0 writes, then all wait
    at the barrier; a process that still finds no file says the directory is not shared."""
    barriers = []
    monkeypatch.setattr(ref_cache, "is_primary", lambda: False)
    monkeypatch.setattr(ref_cache, "barrier", barriers.append)
    calls = []
    with pytest.raises(ReferenceCacheError, match="every process sees"):
        load_or_build(tmp_path, IDENTITY, 5, _filler(calls))
    assert calls == [1] and len(barriers) == 1 and IDENTITY.key in barriers[0]
    assert os.listdir(tmp_path) == []  # wrote nothing

    # process 0: writes before the barrier, then loads
    target = cache_path(tmp_path, IDENTITY)
    monkeypatch.setattr(ref_cache, "is_primary", lambda: True)
    monkeypatch.setattr(ref_cache, "barrier", lambda name: barriers.append(target.is_file()))
    cache = load_or_build(tmp_path, IDENTITY, 5, _filler(calls))
    assert calls == [1, 1] and barriers[-1] is True and cache.path == target
