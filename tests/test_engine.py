"""The exact accumulation engine: layout invariance, docs_per_step rounds, cursor, recompiles."""

from __future__ import annotations

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from engine_fixtures import TinyLM, build_rows, make_loss_fn, random_docs

from jaxrl.train.accumulate import make_accumulate
from jaxrl.train.state import TrainState
from jaxrl.train.step import TrainStep, make_mesh

ROW = 32
SEGMENTS = 8
MAX_LEN = 12


def _model():
    graphdef, params = nnx.split(TinyLM(rngs=nnx.Rngs(0)))
    return graphdef, params


def _reference_grad(graphdef, params, docs, mode):
    """Full-batch gradient from unpacked rows (one document per row), float64 bookkeeping."""
    layout = [[[i] for i in range(len(docs))]]
    rows = build_rows(layout, docs, ROW)
    rows = {k: jnp.asarray(v[0]) for k, v in rows.items()}  # [N, T]

    def objective(p):
        model = nnx.merge(graphdef, p)
        logits = model(rows["tokens"], rows["segment_ids"])
        logp = jax.nn.log_softmax(logits, -1)
        nll = -jnp.take_along_axis(logp, rows["targets"][..., None], -1)[..., 0]
        m = rows["loss_mask"]
        n_docs = len(docs)
        if mode == "token":
            return jnp.sum(nll * m) / jnp.sum(m)
        if mode == "document":
            return jnp.sum(nll * m) / n_docs
        if mode == "constant":
            return jnp.sum(nll * m) / (n_docs * MAX_LEN)
        per_doc = jnp.sum(nll * m, -1) / jnp.maximum(jnp.sum(m, -1), 1.0)
        return jnp.sum(per_doc) / n_docs

    return jax.grad(objective)(params)


def _engine_grad(graphdef, params, docs, layout, mode, dp, docs_per_step=0, num_slots=None):
    mesh = make_mesh(dp)
    loss_fn = make_loss_fn(graphdef, mode=mode, num_segments=SEGMENTS, max_len=MAX_LEN)
    acc = jax.jit(make_accumulate(loss_fn, mesh, docs_per_step=docs_per_step))
    batch = build_rows(layout, docs, ROW, num_slots)
    k = batch["tokens"].shape[1]
    sums = acc(params, {n: jnp.asarray(v) for n, v in batch.items()}, jnp.array([0, k]))
    grads = jax.tree.map(lambda g: g / jnp.maximum(sums.denominator, 1.0), sums.grads)
    return grads, sums


def _packed_layout(rng, n_docs, docs, dp):
    """Random first-fit packing into rows, dealt round-robin to dp ranks, equal slot counts."""
    order = rng.permutation(n_docs)
    rows, fill = [], []
    for d in order:
        n = len(docs[d][0])
        for i, used in enumerate(fill):
            if used + n <= ROW and len(rows[i]) < SEGMENTS - 1:
                rows[i].append(int(d))
                fill[i] += n
                break
        else:
            rows.append([int(d)])
            fill.append(n)
    while len(rows) % dp:
        big = max(range(len(rows)), key=lambda i: len(rows[i]))
        rows.append([rows[big].pop()])
    return [rows[r::dp] for r in range(dp)]


def _max_rel(a, b):
    la, lb = (
        (np.asarray(x) for x in jax.tree.leaves(a)),
        [np.asarray(x) for x in jax.tree.leaves(b)],
    )
    scale = max(float(np.max(np.abs(x))) for x in lb)
    return max(float(np.max(np.abs(x - y))) for x, y in zip(la, lb, strict=True)) / scale


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["token", "sequence", "document", "constant"])
def test_layout_invariance(mode):
    rng = np.random.default_rng(1)
    docs = random_docs(rng, 30)
    graphdef, params = _model()
    ref = _reference_grad(graphdef, params, docs, mode)
    unpacked, _ = _engine_grad(graphdef, params, docs, [[[i] for i in range(30)]], mode, dp=1)
    packed_layout = _packed_layout(rng, 30, docs, dp=8)
    packed, sums = _engine_grad(graphdef, params, docs, packed_layout, mode, dp=8, num_slots=4)
    assert int(sums.documents) == 30
    assert _max_rel(unpacked, ref) < 1e-5
    assert _max_rel(packed, ref) < 1e-5


@pytest.mark.slow
def test_mean_of_micro_batch_means_differs():
    """The per-micro-batch-mean alternative gives a different gradient: the test can fail."""
    rng = np.random.default_rng(2)
    docs = random_docs(rng, 12, lo=2, hi=14)
    graphdef, params = _model()
    ref = _reference_grad(graphdef, params, docs, "token")
    layout = [[[i] for i in range(12)]]
    loss_fn = make_loss_fn(graphdef, mode="token", num_segments=SEGMENTS)
    batch = build_rows(layout, docs, ROW)

    def mean_of_means(p):
        total = 0.0
        for k in range(12):
            terms = loss_fn(p, {n: jnp.asarray(v[0, k : k + 1]) for n, v in batch.items()})
            total = total + terms.numerator / terms.denominator
        return total / 12

    assert _max_rel(jax.grad(mean_of_means)(params), ref) > 1e-2


@pytest.mark.parametrize(
    "counts, target, rounds, total",
    [([2, 2, 2, 2, 2], 6, 3, 6), ([3, 3, 3], 5, 2, 6), ([4, 4], 5, 2, 8), ([3, 1, 2, 4], 5, 3, 6)],
)
def test_docs_per_step_rounds(counts, target, rounds, total):
    rng = np.random.default_rng(3)
    docs = random_docs(rng, sum(counts), lo=2, hi=5)
    starts = np.cumsum([0] + counts)
    layout = [[list(range(starts[i], starts[i + 1])) for i in range(len(counts))]]
    graphdef, params = _model()
    _, sums = _engine_grad(graphdef, params, docs, layout, "document", dp=1, docs_per_step=target)
    assert int(sums.end) == rounds
    assert int(sums.documents) == total


def test_docs_per_step_counts_are_summed_over_ranks():
    """Round counts are psum'd: two ranks with 2 + 1 documents per round, target 5 → 2 rounds."""
    rng = np.random.default_rng(4)
    docs = random_docs(rng, 12, lo=2, hi=5)
    layout = [[[0, 1], [2, 3], [4, 5]], [[6], [7], [8]]]
    graphdef, params = _model()
    _, sums = _engine_grad(graphdef, params, docs, layout, "document", dp=2, docs_per_step=5)
    assert int(sums.end) == 2 and int(sums.documents) == 6


def test_step_constants_prepass_sums_the_consumed_rounds_over_ranks():
    """``step_constants``: a no-grad pre-pass sums the step's LossTerms over exactly the rounds
    the gradient pass consumes (docs_per_step stop) and over the ranks; its fields reach every
    micro-batch of the gradient pass, and a loss linear in them stays exact."""
    rng = np.random.default_rng(4)
    docs = random_docs(rng, 12, lo=2, hi=5)
    layout = [[[0, 1], [2, 3], [4, 5]], [[6], [7], [8]]]
    graphdef, params = _model()
    plain = make_loss_fn(graphdef, mode="token", num_segments=SEGMENTS)

    def loss_fn(params, mb):  # reports the pre-pass denominator it was given, per token
        t = plain(params, mb)
        if "step_den" not in mb:
            return t
        n = jnp.sum((mb["segment_ids"] > 0).astype(jnp.float32))
        return t._replace(metrics={"seen": (mb["step_den"][0] * n, n)})

    acc = make_accumulate(
        loss_fn,
        make_mesh(2),
        docs_per_step=5,
        step_constants=lambda sums: {"step_den": sums.denominator[None]},
    )
    batch = {n: jnp.asarray(v) for n, v in build_rows(layout, docs, ROW).items()}
    sums = jax.jit(acc)(params, batch, jnp.array([0, 3]))
    assert int(sums.end) == 2 and int(sums.documents) == 6
    total, count = sums.metrics["seen"]
    assert float(sums.denominator) > 0
    np.testing.assert_allclose(float(total / count), float(sums.denominator), rtol=1e-6)


def test_docs_per_step_gradient_equals_one_pass_and_cursor_carries():
    rng = np.random.default_rng(5)
    counts = [3, 1, 2, 4]
    docs = random_docs(rng, 10, lo=2, hi=6)
    starts = np.cumsum([0] + counts)
    layout = [[list(range(starts[i], starts[i + 1])) for i in range(4)]]
    graphdef, params = _model()
    grads, sums = _engine_grad(graphdef, params, docs, layout, "document", dp=1, docs_per_step=5)
    assert int(sums.documents) == 6 and float(sums.denominator) == 6.0
    ref = _reference_grad(graphdef, params, docs[:6], "document")  # one pass, divisor 6
    assert _max_rel(grads, ref) < 1e-5

    # The fourth micro-batch is consumed by the next step, from the returned cursor.
    mesh = make_mesh(1)
    loss_fn = make_loss_fn(graphdef, mode="document", num_segments=SEGMENTS)
    tx = optax.sgd(0.1)
    step = TrainStep(loss_fn, tx, mesh, learning_rate=lambda s: 0.1, docs_per_step=5)
    state = step.place(TrainState.create(params, tx, seed=0))
    batch = step.shard_batch(build_rows(layout, docs, ROW))
    state, m1 = step(state, batch, start=0)
    state, m2 = step(state, batch, start=int(m1["cursor"]))
    assert int(m1["num_documents"]) == 6 and int(m2["num_documents"]) == 4
    assert int(m2["cursor"]) == 4 and int(m2["documents_seen"]) == 10
    assert step.compiles == 1


def test_empty_slots_and_stop_bound_add_nothing():
    rng = np.random.default_rng(6)
    docs = random_docs(rng, 6)
    graphdef, params = _model()
    layout = [[[0, 1], [2, 3], [4, 5]]]
    full, s_full = _engine_grad(graphdef, params, docs, layout, "token", dp=1)
    padded, s_pad = _engine_grad(graphdef, params, docs, layout, "token", dp=1, num_slots=8)
    assert _max_rel(padded, full) < 1e-6
    assert int(s_pad.micro_batches) == 3 and int(s_pad.documents) == 6


@pytest.mark.slow
def test_dp8_train_step_equals_dp1_and_skips_non_finite():
    rng = np.random.default_rng(7)
    docs = random_docs(rng, 16)
    graphdef, params = _model()
    loss_fn = make_loss_fn(graphdef, mode="token", num_segments=SEGMENTS)
    tx = optax.adamw(1e-2)
    results = []
    for dp, layout in [
        (1, [[[i, i + 8] for i in range(8)]]),
        (8, [[[i], [i + 8]] for i in range(8)]),
    ]:
        step = TrainStep(
            loss_fn,
            tx,
            make_mesh(dp),
            learning_rate=lambda s: 1e-2,
            max_grad_norm=1.0,
            donate=False,
        )
        state = step.place(TrainState.create(params, tx, seed=0))
        batch = step.shard_batch(build_rows(layout, docs, ROW))
        for _ in range(2):
            state, metrics = step(state, batch)
        results.append((state, metrics))
        assert step.compiles == 1
    (s1, m1), (s8, m8) = results
    assert _max_rel(s8.params, s1.params) < 1e-5
    np.testing.assert_allclose(float(m8["loss"]), float(m1["loss"]), rtol=1e-5)
    np.testing.assert_allclose(float(m8["grad_norm"]), float(m1["grad_norm"]), rtol=1e-5)
    assert int(m1["num_micro_batches"]) == 8 and int(m8["num_micro_batches"]) == 16

    # A NaN gradient skips the update but still counts the documents.
    nan_params = jax.tree.map(lambda p: p * jnp.nan, params)
    step = TrainStep(loss_fn, tx, make_mesh(1), learning_rate=lambda s: 1e-2, donate=False)
    state = TrainState.create(nan_params, tx, seed=0)
    batch = step.shard_batch(build_rows([[[i] for i in range(4)]], docs, ROW))
    new_state, metrics = step(state, batch)
    assert bool(metrics["update_skipped"]) and int(new_state.documents_seen) == 4


@pytest.mark.parametrize(
    "level, loss_type", [("sequence", "seq_mean_token_sum"), ("token", "dapo")]
)
def test_policy_loss_docs_per_step_equals_one_pass(level, loss_type):
    """docs/algorithms/accumulation.md §6 case 2: counts [3,1,2,4], target 5 → 3 rounds;
    GSPO / DAPO gradient equals one pass over the consumed documents with the step-global
    divisor (D = 6 for GSPO)."""
    from jaxrl.data.batching.packing import pack_micro_batches
    from jaxrl.losses.policy import policy_loss_terms

    rng = np.random.default_rng(8)
    docs = random_docs(rng, 10, lo=3, hi=7)
    seqs, masks = [d[0] for d in docs], [d[1] for d in docs]
    old = [rng.normal(size=len(s)).astype(np.float32) - 2.0 for s in seqs]
    adv = rng.normal(size=10).astype(np.float32)
    graphdef, params = _model()

    def loss_fn(p, mb):
        model = nnx.merge(graphdef, p)
        logp = jax.nn.log_softmax(model(mb["tokens"], mb["segment_ids"]), -1)
        logp_BT = jnp.take_along_axis(logp, mb["targets"][..., None], -1)[..., 0]
        return policy_loss_terms(
            logp_BT,
            mb["old_logp"],
            None,
            mb["advantage"],
            mb["loss_mask"],
            mb["segment_ids"],
            loss_type=loss_type,
            importance_sampling_level=level,
        )

    def arrays(packed):
        out = {k: getattr(packed, k) for k in ("tokens", "targets", "loss_mask", "segment_ids")}
        return {
            **out,
            "old_logp": packed.token_fields["old_logp"],
            "advantage": packed.doc_fields["advantage"],
        }

    kw = dict(
        loss_masks=masks,
        token_fields={"old_logp": old},
        doc_fields={"advantage": adv},
        row_len=ROW,
        num_segments=SEGMENTS,
    )
    layout = [[[0, 1, 2], [3], [4, 5], [6, 7, 8, 9]]]
    acc = jax.jit(make_accumulate(loss_fn, make_mesh(1), docs_per_step=5))
    batch = {k: jnp.asarray(v) for k, v in arrays(pack_micro_batches(layout, seqs, **kw)).items()}
    sums = acc(params, batch, jnp.array([0, 4]))
    assert int(sums.end) == 3 and int(sums.documents) == 6
    grads = jax.tree.map(lambda g: g / sums.denominator, sums.grads)

    one = pack_micro_batches([[[i] for i in range(6)]], seqs, **kw)  # unpacked rows
    rows = {k: jnp.asarray(v[0]) for k, v in arrays(one).items()}

    def objective(p):
        t = loss_fn(p, rows)
        return t.numerator / t.denominator

    ref = jax.grad(objective)(params)
    if level == "sequence":
        assert float(sums.denominator) == 6.0
    assert _max_rel(grads, ref) < 1e-5


@pytest.mark.parametrize("dp", [1, 4])
def test_precompiled_step_is_the_step_the_call_runs(dp):
    """``TrainStep.precompile`` (the batch shapes a previous run remembered) compiles on the
    background thread the program the step then runs: the call neither traces nor compiles,
    and the step is the one a step without it takes, bit for bit."""
    rng = np.random.default_rng(8)
    docs = random_docs(rng, 8)
    graphdef, params = _model()
    loss_fn = make_loss_fn(graphdef, mode="token", num_segments=SEGMENTS)
    tx = optax.adamw(1e-2)
    layout = [[[i, i + dp] for i in range(r, 4, dp)] for r in range(dp)]
    out = []
    for ahead in (True, False):
        step = TrainStep(loss_fn, tx, make_mesh(dp), learning_rate=lambda s: 1e-2)
        fresh = jax.tree.map(jnp.copy, params)  # the step donates its state
        state = step.place(TrainState.create(fresh, tx, seed=0))
        rows = build_rows(layout, docs, ROW)
        if ahead:  # as remembered: JSON lists
            signature = [[name, list(x.shape), x.dtype.name] for name, x in sorted(rows.items())]
            step.precompile(state, signature)
            step.precompile(state, signature)  # queued once
        state, metrics = step(state, step.shard_batch(rows))
        assert step.compiles == 1 and len(step.signatures) == 1
        assert step._precompiled.compiled == int(ahead)
        out.append((state, metrics))
    (s_ahead, m_ahead), (s_plain, m_plain) = out
    assert float(m_ahead["loss"]) == float(m_plain["loss"])
    for a, b in zip(jax.tree.leaves(s_ahead.params), jax.tree.leaves(s_plain.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
