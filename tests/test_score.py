"""The no-grad scorer: the trainer's forward on packed rows over every device."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tiny_models import one_layer

from jaxrl.data.batching.packing import pack_sequences
from jaxrl.data.batching.shared_prompt import pack_shared_sequences, prompt_units
from jaxrl.data.documents import prompt_completion_document
from jaxrl.models.sharding import state_shardings
from jaxrl.runtime.mesh import make_mesh
from jaxrl.train.forward import micro_batch_logprobs
from jaxrl.train.score import ROW_FIELDS, DocumentScores, Scorer

CHUNK = 8  # head chunk: rows of 32 tokens take 4 chunks


@pytest.fixture(scope="module")
def case():
    """A tiny model, 40 documents packed into rows of 32 (K padded to 16 slots), and the
    trainer's forward on each row alone ([1, T], as a train micro-batch), at temperature 0.7."""
    _, graphdef, params = one_layer(16)
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 16, rng.integers(3, 20)).astype(np.int32) for _ in range(40)]
    masks = [(rng.random(len(d)) < 0.7).astype(np.float32) for d in docs]
    packed = pack_sequences(docs, row_len=32, loss_masks=masks)
    rows = {k: getattr(packed, k) for k in ROW_FIELDS}
    forward = jax.jit(
        lambda p, mb, t: micro_batch_logprobs(
            nnx.merge(graphdef, p), mb, chunk_size=CHUNK, temperature=t
        )
    )
    logp, entropy = [], []
    for i in range(packed.shape[1]):
        lp, ent = forward(params, {k: v[0, i : i + 1] for k, v in rows.items()}, np.float32(0.7))
        logp.append(np.asarray(lp))
        entropy.append(np.asarray(ent))
    model = nnx.merge(graphdef, params)
    logits = model(rows["tokens"][0], rows["positions"][0], rows["segment_ids"][0])
    argmax_hit = np.asarray(jnp.argmax(logits, axis=-1)) == rows["targets"][0]
    live = packed.segment_ids[0].any(axis=-1)  # the scorer skips the all-padding slots
    want = (np.concatenate(logp)[None], np.concatenate(entropy)[None], argmax_hit[None])
    return graphdef, params, packed, rows, live, want


@pytest.mark.slow
def test_scores_equal_the_train_forward_on_every_mesh(case):
    graphdef, params, packed, rows, live, (logp, entropy, hit) = case
    one = make_mesh(1, devices=jax.devices()[:1])
    replicated = lambda mesh: jax.device_put(params, NamedSharding(mesh, P()))  # noqa: E731
    results = {}
    for name, mesh, p in [
        ("unsharded", None, params),
        ("1 device", one, replicated(one)),
        ("dp 8", make_mesh(8), replicated(make_mesh(8))),
        ("2x2x2", make_mesh(2, 2, 2), replicated(make_mesh(2, 2, 2))),
    ]:
        scorer = Scorer(graphdef, mesh=mesh, chunk_size=CHUNK, rows_per_call=4)
        results[name] = out = scorer.score(p, rows, temperature=0.7)
        assert out.logp.shape == packed.shape and out.logp.dtype == np.float32
        # the train step's forward, row by row, bit for bit (temperature traced on both sides)
        np.testing.assert_array_equal(out.logp[:, live], logp[:, live], err_msg=name)
        np.testing.assert_array_equal(out.entropy[:, live], entropy[:, live], err_msg=name)
        np.testing.assert_array_equal(out.correct[:, live], hit[:, live], err_msg=name)
        assert not out.logp[:, ~live].any() and not out.correct[:, ~live].any()
    assert 0 < hit[:, live].mean() < 1

    # parameters in their own (fsdp × tensor) sharding: same values up to reduction order
    mesh = make_mesh(2, 2, 2)
    sharded = jax.device_put(params, state_shardings(params, mesh))  # the rule table's
    out = Scorer(graphdef, mesh=mesh, chunk_size=CHUNK).score(sharded, rows, temperature=0.7)
    np.testing.assert_allclose(out.logp[:, live], logp[:, live], atol=1e-5)
    np.testing.assert_allclose(out.entropy[:, live], entropy[:, live], atol=1e-5)
    np.testing.assert_array_equal(out.correct[:, live], hit[:, live])


def test_one_compile_per_bucket_whatever_the_temperature(case):
    graphdef, params, _, rows, live, _ = case
    scorer = Scorer(graphdef, mesh=make_mesh(8), chunk_size=CHUNK, rows_per_call=12)
    assert scorer.rows_per_call == 16  # rounded up to a multiple of the 8 row ranks
    cold = scorer.score(params, rows, temperature=0.7)
    hot = scorer.score(params, rows, temperature=1.3)
    assert scorer.compiles == 1
    assert np.abs(cold.entropy[:, live] - hot.entropy[:, live]).min() > 0  # the temperature acts
    np.testing.assert_array_equal(cold.correct, hot.correct)  # the argmax does not see it
    short = {k: v[..., :16] for k, v in rows.items()}  # another T bucket: a second program
    scorer.score(params, short)
    assert scorer.compiles == 2


def test_documents_aggregate_the_scored_tokens(case):
    graphdef, params, packed, rows, _, _ = case
    scorer = Scorer(graphdef, mesh=make_mesh(2, 2, 2), chunk_size=CHUNK)
    scores = scorer.score(params, rows)
    total = scorer.documents(params, packed)
    mean = scorer.documents(params, packed, mean=True)
    assert total.logps.shape == (40,)
    on = (packed.loss_mask > 0) & (packed.segment_ids > 0)
    for r, k, s in zip(*np.nonzero(packed.doc_sample_index >= 0), strict=True):
        if s == 0:
            continue
        doc = packed.doc_sample_index[r, k, s]
        here = on[r, k] & (packed.segment_ids[r, k] == s)
        np.testing.assert_allclose(total.logps[doc], scores.logp[r, k][here].sum(), rtol=1e-5)
        np.testing.assert_allclose(
            mean.logps[doc], scores.logp[r, k][here].sum() / max(here.sum(), 1), rtol=1e-5
        )
        assert total.scored[doc] == here.any()
        assert total.correct[doc] == (here.any() and scores.correct[r, k][here].all())


def test_exact_match_counts_correct_among_scored_documents():
    """Hand-made scores: documents 0 and 2 right, 1 and 4 wrong, 3 unscored (no loss token)."""
    scores = DocumentScores(
        logps=np.array([-1.0, -2.0, -0.5, np.nan, -3.0], np.float32),
        correct=np.array([True, False, True, False, False]),
        scored=np.array([True, True, True, False, True]),
    )
    assert scores.exact_match() == 0.5  # 2 of 4 scored
    assert scores.exact_match([0, 1]) == 0.5
    assert scores.exact_match([0, 2, 3]) == 1.0  # the unscored document does not count
    assert scores.exact_match(np.array([1, 4])) == 0.0
    assert scores.exact_match([3]) == 0.0  # nothing scored: 0, not NaN
    assert scores.exact_match([2, 2, 1]) == pytest.approx(2 / 3)  # ids as given, repeats too


def test_token_logprobs_on_shared_prompt_rows_equal_the_unshared(case):
    """GRPO's old / reference log-probs (``token_logprobs``) scored in the shared-prompt layout
    (grpo.shared_prompt_packing) equal the unshared documents' at every token, prompts included:
    three prompt groups, one of them cut by the row budget into parts, and a lone document."""
    graphdef, params, *_ = case
    rng = np.random.default_rng(1)
    docs, masks, plens = [], [], []
    for prompt_len, n, longest in ((5, 4, 6), (7, 6, 8), (6, 3, 4), (4, 1, 5)):
        prompt = rng.integers(0, 16, prompt_len)
        for _ in range(n):
            completion = rng.integers(0, 16, int(rng.integers(1, longest + 1)))
            ids, mask = prompt_completion_document(prompt, completion)
            docs.append(ids.astype(np.int32))
            masks.append(mask)
            plens.append(prompt_len)
    units = prompt_units(
        range(len(docs)), sequences=docs, prompt_lengths=plens, group_keys=[0] * len(docs),
        max_tokens=32, loss_masks=masks,
    )  # fmt: skip
    assert len(units) > 4  # the 6-completion group is split by the budget
    scorer = Scorer(graphdef, chunk_size=CHUNK, row_len=32, temperature=0.7)
    plain = scorer.token_logprobs(params, docs)
    shared = scorer.token_logprobs(params, docs, prompt_lengths=plens, loss_masks=masks)
    assert scorer.compiles == 2  # the shared rows' program reads parent_ids
    for i, (a, b) in enumerate(zip(plain, shared, strict=True)):
        assert a.shape == b.shape == (len(docs[i]),)
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-5, err_msg=f"document {i}")
    packed = pack_shared_sequences(docs, plens, row_len=32, loss_masks=masks)
    assert packed.trained_tokens < packed.tokens_unshared == sum(map(len, docs))
