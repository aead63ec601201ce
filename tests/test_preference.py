"""Preference pairs: the arithmetic task, the JSONL loader, tokenisation and pair scheduling."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxrl.data.packing import PackingError, pack_micro_batches
from jaxrl.data.preference import (
    PreferenceDataError,
    PreferencePair,
    arithmetic_pairs,
    encode_pairs,
    load_jsonl_pairs,
    pair_micro_batches,
    preference_accuracy,
)
from jaxrl.data.tasks import ArithmeticTask
from jaxrl.data.tokenizer import char_tokenizer
from jaxrl.losses.dpo import pair_documents

TASK = ArithmeticTask(max_digits=2, reverse_answer=True, pad_operands=True, seed=3)


# ------------------------------------------------------------------ built-in task


def test_arithmetic_pairs_chosen_correct_rejected_one_digit_off():
    pairs = arithmetic_pairs(TASK, 300)
    for pair, ex in zip(pairs, TASK.examples(300), strict=True):
        assert (pair.prompt, pair.chosen) == (ex.prompt, ex.answer)
        assert len(pair.rejected) == len(pair.chosen) and pair.rejected != pair.chosen
        diff = [
            i for i, (a, b) in enumerate(zip(pair.chosen, pair.rejected, strict=True)) if a != b
        ]
        assert len(diff) == 1 and pair.rejected[diff[0]].isdigit()
        if len(pair.rejected) > 1:  # reversed answers: the most significant digit is last
            assert pair.rejected[-1] != "0"


def test_arithmetic_pairs_deterministic_and_seeded():
    assert arithmetic_pairs(TASK, 50) == arithmetic_pairs(TASK, 50)
    other = ArithmeticTask(max_digits=2, reverse_answer=True, pad_operands=True, seed=4)
    assert arithmetic_pairs(other, 50) != arithmetic_pairs(TASK, 50)


def test_train_and_held_out_pairs_are_disjoint():
    train = {p.prompt for p in arithmetic_pairs(TASK, 3000)}
    held = {p.prompt for p in arithmetic_pairs(TASK, 300, split="eval")}
    assert len(train) == 3000 and len(held) == 300
    assert not train & held


# ------------------------------------------------------------------ JSONL loader


def _write(tmp_path, lines):
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_loader_reads_pairs_and_skips_blank_lines(tmp_path):
    rows = [{"prompt": "1+1=", "chosen": "2", "rejected": "3", "extra": 1}, {}]
    rows[1] = {"prompt": "p", "chosen": "c", "rejected": "r"}
    path = _write(tmp_path, [json.dumps(rows[0]), "", json.dumps(rows[1])])
    assert load_jsonl_pairs(path) == [
        PreferencePair("1+1=", "2", "3"),
        PreferencePair("p", "c", "r"),
    ]


@pytest.mark.parametrize(
    "bad, message",
    [
        ('{"prompt": "p", "chosen": "c"}', r"pairs.jsonl:3: missing key 'rejected'"),
        ('{"prompt": "p", "chosen": "", "rejected": "r"}', r"pairs.jsonl:3: 'chosen' is an empty"),
        ('{"prompt": "", "chosen": "c", "rejected": "r"}', r"pairs.jsonl:3: 'prompt' is an empty"),
        ('{"prompt": "p", "chosen": 1, "rejected": "r"}', r"pairs.jsonl:3: 'chosen' must be a str"),
        ('{"prompt": "p", "chosen": "c", ', r"pairs.jsonl:3: bad JSON"),
        ('["p", "c", "r"]', r"pairs.jsonl:3: expected an object"),
    ],
)
def test_jsonl_loader_errors_name_the_line(tmp_path, bad, message):
    good = json.dumps({"prompt": "p", "chosen": "c", "rejected": "r"})
    path = _write(tmp_path, [good, good, bad, good])
    with pytest.raises(PreferenceDataError, match=message):
        load_jsonl_pairs(path)


def test_jsonl_loader_rejects_a_file_without_pairs(tmp_path):
    with pytest.raises(PreferenceDataError, match="no preference pairs"):
        load_jsonl_pairs(_write(tmp_path, ["", "  "]))


# ------------------------------------------------------------------ tokenisation


def test_encode_pairs_documents_and_masks():
    tok = char_tokenizer(TASK.alphabet)
    pairs = [PreferencePair("12+30=", "24", "25"), PreferencePair("1+1=", "2", "13")]
    docs = encode_pairs(pairs, tok, max_length=16)
    assert len(docs.sequences) == 4
    for p, pair in enumerate(pairs):
        prompt = [tok.bos_id, *tok.encode(pair.prompt)]
        for d, response in ((2 * p, pair.chosen), (2 * p + 1, pair.rejected)):
            expected = prompt + tok.encode(response) + [tok.eos_id]
            assert docs.sequences[d].tolist() == expected
            mask = np.r_[np.zeros(len(prompt)), np.ones(len(response) + 1)]
            np.testing.assert_array_equal(docs.masks[d], mask)
        assert docs.pair_lengths[p] == len(docs.sequences[2 * p]) + len(docs.sequences[2 * p + 1])
    other = encode_pairs(pairs[::-1], tok, max_length=16)
    assert other.fingerprint() != docs.fingerprint()
    assert encode_pairs(pairs, tok, max_length=16).fingerprint() == docs.fingerprint()


def test_encode_pairs_too_long_errors_name_the_row():
    tok = char_tokenizer(TASK.alphabet)
    pairs = [PreferencePair("1+1=", "2", "3"), PreferencePair("11+11=", "22", "2222")]
    with pytest.raises(PreferenceDataError, match=r"row 1: the rejected document has 12 tokens"):
        encode_pairs(pairs, tok, max_length=11)
    with pytest.raises(PreferenceDataError, match=r"row 1: the pair has 10 \+ 12 = 22 tokens > "):
        encode_pairs(pairs, tok, max_length=16, max_tokens=21)
    encode_pairs(pairs, tok, max_length=16, max_tokens=22)  # fits exactly


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
    docs = encode_pairs(arithmetic_pairs(TASK, 12), tok, max_length=16)
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
