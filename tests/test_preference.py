"""Preference pairs: the built-in task's rows, TRL preference files through the one reader,
tokenisation and pair scheduling."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxrl.data.batching.packing import PackingError, pack_micro_batches
from jaxrl.data.batching.preference import pair_micro_batches, preference_accuracy
from jaxrl.data.datasets import DataError, read_dataset, rows_dataset
from jaxrl.data.documents import dpo_documents
from jaxrl.data.tasks import ArithmeticTask
from jaxrl.data.tokenizer import char_tokenizer
from jaxrl.losses.dpo import pair_documents

TASK = ArithmeticTask(max_digits=2, reverse_answer=True, pad_operands=True, seed=3)


# ------------------------------------------------------------------ built-in task


def test_arithmetic_pairs_chosen_correct_rejected_one_digit_off():
    pairs = TASK.rows("dpo", 300)
    for pair, ex in zip(pairs, TASK.examples(300), strict=True):
        assert (pair["prompt"], pair["chosen"]) == (ex.prompt, ex.answer)
        chosen, rejected = pair["chosen"], pair["rejected"]
        assert len(rejected) == len(chosen) and rejected != chosen
        diff = [i for i, (a, b) in enumerate(zip(chosen, rejected, strict=True)) if a != b]
        assert len(diff) == 1 and rejected[diff[0]].isdigit()
        if len(rejected) > 1:  # reversed answers: the most significant digit is last
            assert rejected[-1] != "0"


def test_arithmetic_pairs_deterministic_and_seeded():
    assert TASK.rows("dpo", 50) == TASK.rows("dpo", 50)
    other = ArithmeticTask(max_digits=2, reverse_answer=True, pad_operands=True, seed=4)
    assert other.rows("dpo", 50) != TASK.rows("dpo", 50)


def test_train_and_held_out_pairs_are_disjoint():
    train = {p["prompt"] for p in TASK.rows("dpo", 3000)}
    held = {p["prompt"] for p in TASK.rows("dpo", 300, split="eval")}
    assert len(train) == 3000 and len(held) == 300
    assert not train & held


def test_built_in_pairs_and_the_same_rows_from_a_file_give_the_same_documents(tmp_path):
    """The task's rows take the reader and tokeniser of users' data: written to JSONL and read
    back, they give the same tokens, masks and fingerprint."""
    tok = char_tokenizer(TASK.alphabet)
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in TASK.rows("dpo", 40)))
    built_in, _, _ = dpo_documents(TASK.dataset("dpo", 40), tok, max_length=16)
    from_file, _, _ = dpo_documents(read_dataset(path, "dpo"), tok, max_length=16)
    assert built_in.fingerprint() == from_file.fingerprint()
    np.testing.assert_array_equal(built_in.pair_lengths, from_file.pair_lengths)


# ------------------------------------------------------------------ preference files


def _write(tmp_path, lines):
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_reader_reads_pairs_and_skips_blank_lines(tmp_path):
    rows = [{"prompt": "1+1=", "chosen": "2", "rejected": "3", "extra": 1}, {}]
    rows[1] = {"prompt": "p", "chosen": "c", "rejected": "r"}
    path = _write(tmp_path, [json.dumps(rows[0]), "", json.dumps(rows[1])])
    data = read_dataset(path, "dpo")
    assert data.rows == rows and data.format == "preference" and not data.conversational
    assert data.where == [f"{path}:1", f"{path}:3"]


@pytest.mark.parametrize(
    "bad, message",
    [
        ('{"prompt": "p", "chosen": "c"}', r"pairs.jsonl:3: missing 'rejected'"),
        ('{"prompt": "p", "chosen": 1, "rejected": "r"}', r"pairs.jsonl:3: 'chosen' must be a str"),
        ('{"prompt": "p", "chosen": "c", ', r"pairs.jsonl:3: bad JSON"),
        ('["p", "c", "r"]', r"pairs.jsonl:3: a row must be a JSON object"),
    ],
)
def test_reader_errors_name_the_line(tmp_path, bad, message):
    good = json.dumps({"prompt": "p", "chosen": "c", "rejected": "r"})
    path = _write(tmp_path, [good, good, bad, good])
    with pytest.raises(DataError, match=message):
        read_dataset(path, "dpo")


def test_reader_rejects_a_file_without_pairs(tmp_path):
    with pytest.raises(DataError, match="no rows"):
        read_dataset(_write(tmp_path, ["", "  "]), "dpo")


# ------------------------------------------------------------------ tokenisation


def _pairs(rows):
    return rows_dataset(rows, "dpo", source="pairs")


def test_pair_documents_and_masks():
    tok = char_tokenizer(TASK.alphabet)
    rows = [
        {"prompt": "12+30=", "chosen": "24", "rejected": "25"},
        {"prompt": "1+1=", "chosen": "2", "rejected": "13"},
    ]
    docs, _, _ = dpo_documents(_pairs(rows), tok, max_length=16)
    assert len(docs.sequences) == 4
    for p, pair in enumerate(rows):
        prompt = [tok.bos_id, *tok.encode(pair["prompt"])]
        for d, response in ((2 * p, pair["chosen"]), (2 * p + 1, pair["rejected"])):
            expected = prompt + tok.encode(response) + [tok.eos_id]
            assert docs.sequences[d].tolist() == expected
            mask = np.r_[np.zeros(len(prompt)), np.ones(len(response) + 1)]
            np.testing.assert_array_equal(docs.masks[d], mask)
        assert docs.pair_lengths[p] == len(docs.sequences[2 * p]) + len(docs.sequences[2 * p + 1])
    other, _, _ = dpo_documents(_pairs(rows[::-1]), tok, max_length=16)
    assert other.fingerprint() != docs.fingerprint()
    again, _, _ = dpo_documents(_pairs(rows), tok, max_length=16)
    assert again.fingerprint() == docs.fingerprint()


def test_too_long_pairs_are_truncated_and_counted_and_a_pair_over_a_row_names_it():
    """One length policy for built-in and users' pairs (docs/data.md): a response over
    ``max_length`` keeps its first tokens and is counted; a pair that cannot fit one row of
    ``max_tokens`` is an error naming the row."""
    tok = char_tokenizer(TASK.alphabet)
    rows = [
        {"prompt": "1+1=", "chosen": "2", "rejected": "3"},
        {"prompt": "11+11=", "chosen": "22", "rejected": "2222"},
    ]
    docs, report, kept = dpo_documents(_pairs(rows), tok, max_length=11)
    assert kept == [0, 1] and report.over_length == 1 and report.dropped == 0
    assert len(docs.sequences[3]) == 11  # the 12-token rejected document keeps its first 11
    with pytest.raises(DataError, match=r"row 1: the pair has 10 \+ 12 = 22 tokens > "):
        dpo_documents(_pairs(rows), tok, max_length=16, max_tokens=21)
    dpo_documents(_pairs(rows), tok, max_length=16, max_tokens=22)  # fits exactly


# ------------------------------------------------------------------ scheduling pairs


def test_pair_micro_batches_keep_pairs_adjacent_and_whole():
    rng = np.random.default_rng(0)
    lengths = rng.integers(4, 30, size=40)
    ids = rng.permutation(40)[:33].tolist()
    layout = pair_micro_batches(ids, lengths, dp_size=4, max_tokens=64)
    assert len({len(rank) for rank in layout}) == 1
    seen = []
    for rank in layout:
        for mb in rank:
            assert len(mb) % 2 == 0
            chosen, rejected = mb[0::2], mb[1::2]
            assert all(c % 2 == 0 and r == c + 1 for c, r in zip(chosen, rejected, strict=True))
            assert sum(lengths[c // 2] for c in chosen) <= 64
            seen += [c // 2 for c in chosen]
    assert sorted(seen) == sorted(ids)


def test_packed_pairs_sit_in_segments_2p_minus_1_and_2p():
    tok = char_tokenizer(TASK.alphabet)
    docs, _, _ = dpo_documents(TASK.dataset("dpo", 12), tok, max_length=16)
    layout = pair_micro_batches(range(12), docs.pair_lengths, dp_size=2, max_tokens=48)
    packed = pack_micro_batches(layout, docs.sequences, loss_masks=docs.masks, row_len=48)
    chosen_BPr, rejected_BPr = pair_documents(
        packed.doc_sample_index.reshape(-1, packed.num_segments)
    )
    real = chosen_BPr >= 0
    np.testing.assert_array_equal(real, rejected_BPr >= 0)
    assert np.all(chosen_BPr[real] % 2 == 0) and np.all(rejected_BPr[real] == chosen_BPr[real] + 1)
    assert sorted((chosen_BPr[real] // 2).tolist()) == list(range(12))


def test_pair_longer_than_a_row_is_rejected_by_the_schedule():
    with pytest.raises(PackingError, match=r"pair 2 has 50 tokens > schedule.max_tokens=40"):
        pair_micro_batches([0, 1, 2], np.array([10, 20, 50]), dp_size=1, max_tokens=40)


def test_preference_accuracy_is_strict():
    pc, pr = np.array([1.0, 0.0, -1.0, 2.0]), np.array([0.0, 0.0, 0.0, 1.0])
    assert preference_accuracy(pc, pr) == 0.5  # the tie (0, 0) counts as wrong
    assert preference_accuracy(pc, pr, pc, pr) == 0.0  # policy == reference: every z = 0
    assert preference_accuracy(pc, pr, pr, pc) == 0.5  # z = 2 (π_c − π_r): two of four
