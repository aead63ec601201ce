"""Packed device batches (jaxrl.data.batching.packing): layout, shifts, buckets, padding, errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxrl.data.batching.packing import (
    PackingError,
    document_index,
    pack_micro_batches,
    pack_sequences,
    pick_bucket,
)
from jaxrl.data.batching.schedule import build_dp_schedule


def test_document_index_fast_llm_clamp_example():
    assert document_index([3, 4], 10).tolist() == [1, 1, 1, 2, 2, 2, 2, 2, 2, 2]
    assert document_index([3, 4], 7).tolist() == [1, 1, 1, 2, 2, 2, 2]
    assert document_index([], 4).tolist() == [0, 0, 0, 0]
    assert document_index([2, 1, 1], 6).dtype == np.int32
    with pytest.raises(PackingError, match="do not fit row_len=6"):
        document_index([3, 4], 6)


def test_single_row_layout_exactly():
    # rank 0 holds two micro-batches: [0, 2] and [1]; rank 1 holds [3] and [4].
    seqs = [[11, 12, 13], [21, 22, 23, 24], [31], [41, 42], [51, 52, 53, 54, 55]]
    masks = [[0, 1, 1], [0, 0, 1, 1], [1], [1, 0], [0, 1, 1, 0, 1]]
    mbs = [[[0, 2], [1]], [[3], [4]]]
    b = pack_micro_batches(
        mbs,
        seqs,
        loss_masks=masks,
        row_len=6,
        num_slots=4,
        doc_fields={"adv": [0.5, -1.0, 2.0, 3.0, 4.0]},
        token_fields={"old_logp": [np.arange(len(s)) * 0.1 for s in seqs]},
    )
    assert b.shape == (2, 4, 6) and b.num_segments == 4 and b.num_micro_batches == 2
    assert b.tokens[0, 0].tolist() == [11, 12, 13, 31, 0, 0]
    assert b.positions[0, 0].tolist() == [0, 1, 2, 0, 0, 0]
    assert b.segment_ids[0, 0].tolist() == [1, 1, 1, 2, 0, 0]
    assert b.targets[0, 0].tolist() == [12, 13, 0, 0, 0, 0]
    assert b.loss_mask[0, 0].tolist() == [1, 1, 0, 0, 0, 0]
    assert b.token_fields["old_logp"][0, 0] == pytest.approx([0.1, 0.2, 0, 0, 0, 0])
    assert b.tokens[0, 1].tolist() == [21, 22, 23, 24, 0, 0]
    assert b.targets[0, 1].tolist() == [22, 23, 24, 0, 0, 0]
    assert b.loss_mask[0, 1].tolist() == [0, 1, 1, 0, 0, 0]
    assert b.loss_mask[1, 0].tolist() == [0, 0, 0, 0, 0, 0]  # [41, 42] with mask [1, 0]
    assert b.loss_mask[1, 1].tolist() == [1, 1, 0, 1, 0, 0]
    assert b.doc_sample_index[:, :2].tolist() == [
        [[-1, 0, 2, -1], [-1, 1, -1, -1]],
        [[-1, 3, -1, -1], [-1, 4, -1, -1]],
    ]
    assert b.doc_fields["adv"][0, 0].tolist() == [0.0, 0.5, 2.0, 0.0]
    assert b.num_docs.tolist() == [[2, 1, 0, 0], [1, 1, 0, 0]]
    assert b.num_tokens.tolist() == [[4, 4, 0, 0], [2, 5, 0, 0]]
    assert b.num_loss_tokens.tolist() == [[2, 2, 0, 0], [0, 3, 0, 0]]
    # slots past the real micro-batches are fully padded
    for arr in (b.tokens, b.segment_ids, b.targets, b.loss_mask, b.token_fields["old_logp"]):
        assert not arr[:, 2:].any()
    assert (b.doc_sample_index[:, 2:] == -1).all() and not b.doc_fields["adv"][:, 2:].any()


def test_dtypes():
    b = pack_sequences(
        [[1, 2], [3]],
        row_len=4,
        token_fields={"x": [[0.0, 1.0], [2.0]]},
        doc_fields={"a": [1.0, 2.0]},
    )
    for name in (
        "tokens",
        "positions",
        "segment_ids",
        "targets",
        "doc_sample_index",
        "num_docs",
        "num_tokens",
    ):
        assert getattr(b, name).dtype == np.int32, name
    for arr in (b.loss_mask, b.num_loss_tokens, b.token_fields["x"], b.doc_fields["a"]):
        assert arr.dtype == np.float32


def test_default_mask_counts_every_next_token_prediction():
    b = pack_sequences([[1, 2, 3], [4], [5, 6]], row_len=8)
    assert b.segment_ids.tolist() == [[[1, 1, 1, 2, 3, 3, 0, 0]]]
    assert b.targets.tolist() == [[[2, 3, 0, 0, 6, 0, 0, 0]]]
    assert b.loss_mask.tolist() == [[[1, 1, 0, 0, 1, 0, 0, 0]]]
    assert b.num_loss_tokens.tolist() == [[3.0]]


def test_document_counts_include_docs_without_loss_tokens():
    b = pack_sequences([[7], [8, 9]], row_len=4, loss_masks=[[1], [1, 0]])
    assert b.num_docs.tolist() == [[2]] and b.num_loss_tokens.tolist() == [[0.0]]


@pytest.mark.parametrize(
    ("needed", "spec", "expected"),
    [(1, None, 1), (5, None, 8), (8, None, 8), (0, None, 1), (5, 7, 7), (5, [4, 16, 8], 8)],
)
def test_pick_bucket(needed, spec, expected):
    assert pick_bucket(needed, spec, "T") == expected


def test_pick_bucket_errors():
    with pytest.raises(PackingError, match="K: need 9 but it is fixed at 8"):
        pick_bucket(9, 8, "K")
    with pytest.raises(PackingError, match=r"S: need 9, larger than every bucket in \[4, 8\]"):
        pick_bucket(9, [4, 8], "S")


def test_buckets_choose_static_shapes():
    seqs = [[1] * 5, [2] * 3, [3] * 2]
    b = pack_micro_batches([[[0], [1, 2]]], seqs)
    assert b.shape == (1, 2, 8) and b.num_segments == 4  # T: 5 -> 8; S: 2 docs + 1 -> 4
    b = pack_micro_batches([[[0], [1, 2]]], seqs, row_len=[6, 12], num_slots=[3, 5], num_segments=3)
    assert b.shape == (1, 3, 6) and b.num_segments == 3


def test_sample_longer_than_row_is_rejected_by_name():
    seqs = [[1] * 4, [2] * 40, [3] * 2]
    with pytest.raises(PackingError, match="sample 1 has 40 tokens > row length T=32"):
        pack_micro_batches([[[0], [1]]], seqs, row_len=32)
    with pytest.raises(PackingError, match="sample 1 has 40 tokens > row length T=32"):
        pack_micro_batches([[[0], [1]]], seqs, row_len=[16, 32])
    with pytest.raises(PackingError, match="sample 1 has 40 tokens > row length T=32"):
        pack_sequences(seqs, row_len=32)
    # the schedule keeps an oversized sample alone (slime parity); the packer then names it
    sched = build_dp_schedule([len(s) for s in seqs], dp_size=1, max_tokens=32)
    with pytest.raises(PackingError, match="sample 1 has 40 tokens"):
        pack_micro_batches(sched.steps[0], seqs, row_len=32)


def test_row_over_fixed_length_and_other_errors():
    seqs = [[1] * 5, [2] * 5]
    with pytest.raises(PackingError, match=r"rank 0 micro-batch 0 holds 10 tokens > row length"):
        pack_micro_batches([[[0, 1]]], seqs, row_len=8)
    with pytest.raises(PackingError, match=r"same number of micro-batches, got \[1, 2\]"):
        pack_micro_batches([[[0]], [[1], [0]]], seqs)
    with pytest.raises(PackingError, match="loss_mask of sample 1 has shape"):
        pack_micro_batches([[[0, 1]]], seqs, loss_masks=[[1] * 5, [1] * 4])
    with pytest.raises(PackingError, match="old_logp of sample 0"):
        pack_micro_batches([[[0, 1]]], seqs, token_fields={"old_logp": [[0.0], [0.0] * 5]})
    with pytest.raises(PackingError, match="not integers"):
        pack_micro_batches([[[0]]], [[1.5, 2.5]])
    with pytest.raises(PackingError, match="micro-batch 0 is empty"):
        pack_micro_batches([[[]]], seqs)
    with pytest.raises(PackingError, match="sample 1 is empty"):
        pack_micro_batches([[[0, 1]]], [[1, 2], []])
    with pytest.raises(PackingError, match="must be 1-D"):
        pack_micro_batches([[[0]]], [np.ones((2, 2), dtype=np.int32)])


def test_segment_ids_agree_with_document_index_on_real_tokens():
    seqs = [[1] * n for n in (3, 4, 1, 6, 2)]
    b = pack_sequences(seqs, row_len=10)
    for k in range(b.num_micro_batches):
        lens = [len(seqs[i]) for i in b.doc_sample_index[0, k] if i >= 0]
        index = document_index(lens, 10)
        real = b.segment_ids[0, k] > 0
        assert (index[real] == b.segment_ids[0, k][real]).all()
        assert (index[~real] == len(lens)).all()  # padding clamps onto the last document


def unpacked_reference(seqs, masks, i):
    """Per-document targets and target-aligned mask, computed without any packing."""
    return list(seqs[i][1:]), [float(x) for x in masks[i][1:]]


@st.composite
def packing_cases(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n = draw(st.integers(4, 40))
    dp = draw(st.sampled_from([1, 2, 4]))
    cap = draw(st.integers(16, 64))
    lengths = rng.integers(1, cap + 1, size=n)
    seqs = [rng.integers(1, 1000, size=int(x)).astype(np.int32) for x in lengths]
    masks = [rng.integers(0, 2, size=int(x)) for x in lengths]
    return seqs, masks, dp, cap


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(packing_cases(), st.sampled_from(["ffd", "first_fit"]))
def test_packed_equals_unpacked(case, packing):
    """Every kept document appears once, whole, with its own next-token targets and mask."""
    seqs, masks, dp, cap = case
    sched = build_dp_schedule([len(s) for s in seqs], dp_size=dp, max_tokens=cap, packing=packing)
    step = sched.steps[0]
    logp = [np.linspace(0, 1, len(s)) for s in seqs]
    adv = np.arange(len(seqs), dtype=np.float32) - 3
    b = pack_micro_batches(
        step,
        seqs,
        loss_masks=masks,
        row_len=cap,
        token_fields={"logp": logp},
        doc_fields={"adv": adv},
    )
    assert b.shape[:2] == (dp, pick_bucket(step.num_micro_batches, None, "K"))
    assert b.num_docs.sum() == len(step.sample_indices)
    seen = b.split_by_sample(b.tokens)
    assert sorted(seen) == sorted(step.sample_indices)
    targets = b.split_by_sample(b.targets)
    mask = b.split_by_sample(b.loss_mask)
    lp = b.split_by_sample(b.token_fields["logp"])
    pos = b.split_by_sample(b.positions)
    for i in step.sample_indices:
        ref_targets, ref_mask = unpacked_reference(seqs, masks, i)
        assert seen[i].tolist() == seqs[i].tolist()
        assert pos[i].tolist() == list(range(len(seqs[i])))
        assert targets[i].tolist() == [*ref_targets, 0]
        assert mask[i].tolist() == [*ref_mask, 0.0]
        np.testing.assert_allclose(lp[i], [*logp[i][1:], 0.0], rtol=1e-6)
    assert b.num_loss_tokens.sum() == sum(np.sum(masks[i][1:]) for i in step.sample_indices)
    slot_adv = b.doc_fields["adv"][b.doc_sample_index >= 0]
    assert sorted(slot_adv.tolist()) == sorted(adv[step.sample_indices].tolist())
    assert (b.num_tokens <= cap).all()
    assert not b.loss_mask[b.segment_ids == 0].any()


def test_row_buckets_follow_the_budget():
    from jaxrl.data.batching.packing import row_buckets

    assert row_buckets(256) == (64, 128, 256)
    assert row_buckets(300) == (64, 128, 256, 300)
    assert row_buckets(40) == (40,)
    assert row_buckets(4096) == (
        (64, 128, 256, 384, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048)
        + (2560, 3072, 3584, 4096)
    )
    assert all(t % 128 == 0 for t in row_buckets(8192) if t >= 128)  # the kernels' block
    assert pick_bucket(661, row_buckets(4096), "T") == 768  # the longest row, not the budget
    assert pick_bucket(556, row_buckets(2048), "T") == 640
    for needed in range(65, 4097):  # a row is always at least 2/3 full (past the smallest)
        assert needed / pick_bucket(needed, row_buckets(4096), "T") > 0.5
