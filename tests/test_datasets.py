"""Reading TRL-format datasets (JSONL, JSON, Parquet, save_to_disk), format validation with
errors that name file and line, and rows → tokens checked against transformers' tokenizer."""

from __future__ import annotations

import json

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hf_fixtures import write_tiny_tokenizer
from transformers import AutoTokenizer

from jaxrl.data.datasets import DataError, read_dataset, read_rows
from jaxrl.data.documents import dpo_documents, grpo_prompts, sft_documents
from jaxrl.data.tasks import ArithmeticTask
from jaxrl.data.tokenizer import char_tokenizer, load_tokenizer

ROWS = [
    {"prompt": "What is 2 + 2?", "answer": "4"},
    {"prompt": [{"role": "user", "content": "Name a color."}], "answer": "red"},
]
MSG = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _write(path, text: str | bytes):
    (path.write_bytes if isinstance(text, bytes) else path.write_text)(text)
    return path


# -- readers --------------------------------------------------------------------------------


def test_every_reader_returns_the_same_plain_rows(tmp_path):
    rows = [{"prompt": "What is 2 + 2?", "answer": "4"}, {"prompt": "Say hi", "answer": "hi"}]
    jsonl = _jsonl(tmp_path / "d.jsonl", rows)
    array = _write(tmp_path / "d.json", json.dumps(rows, indent=2))
    lines_json = _jsonl(tmp_path / "lines.json", rows)  # Dataset.to_json writes JSON lines
    parquet = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    disk = tmp_path / "disk"
    datasets.Dataset.from_list(rows).save_to_disk(str(disk))
    ddict = tmp_path / "dict"
    datasets.DatasetDict(
        train=datasets.Dataset.from_list(rows), test=datasets.Dataset.from_list(rows[:1])
    ).save_to_disk(str(ddict))
    for source in (jsonl, array, lines_json, parquet, disk, ddict):
        got, where, _ = read_rows(source)
        assert got == rows and all(type(r) is dict for r in got), source
        assert len(where) == 2
    assert read_rows(jsonl)[1] == [f"{jsonl}:1", f"{jsonl}:2"]
    assert read_rows(array)[1] == [f"{array}:2", f"{array}:6"]  # the line each object starts on
    assert read_rows(parquet)[1] == [f"{parquet} row 0", f"{parquet} row 1"]
    assert read_rows(ddict, split="test")[0] == rows[:1]
    with pytest.raises(DataError, match=r"no split 'validation'; it has \['test', 'train'\]"):
        read_rows(ddict, split="validation")


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("bad.jsonl", '{"prompt": "a"}\n\n{"prompt": "b",}\n', r"bad.jsonl:3: bad JSON \("),
        ("bad.json", '[\n{"prompt": "a"},\n{"prompt" "b"}\n]', r"bad.json:3: bad JSON \("),
        ("open.json", '[{"prompt": "a"},', r"open.json:1: bad JSON \(the array is not closed"),
        ("latin.jsonl", b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n', r"latin.jsonl:2: not UTF-8"),
        ("latin.json", b'[\n{"prompt": "a"},\n{"prompt": "\xff"}]', r"latin.json:3: not UTF-8"),
        (
            "deep.jsonl",
            '{"prompt": "a"}\n' + "[" * 100_000 + "]" * 100_000,
            r"deep.jsonl:2: the value is nested too deeply",
        ),
        ("empty.jsonl", "\n  \n", r"empty.jsonl: no rows"),
        ("data.csv", "prompt\na\n", r"unknown data file type '.csv'"),
    ],
)
def test_unreadable_files_name_file_and_line(tmp_path, name, content, message):
    with pytest.raises(DataError, match=message):
        read_rows(_write(tmp_path / name, content))


def test_a_missing_path_and_a_bad_parquet_file(tmp_path):
    with pytest.raises(DataError, match="no such file or directory"):
        read_rows(tmp_path / "missing.jsonl")
    with pytest.raises(DataError, match="not a readable Parquet file"):
        read_rows(_write(tmp_path / "x.parquet", "not parquet"))
    with pytest.raises(DataError, match="not a directory written by datasets' save_to_disk"):
        (tmp_path / "plain_dir").mkdir()
        read_rows(tmp_path / "plain_dir")


# -- formats --------------------------------------------------------------------------------


def test_formats_are_detected_and_other_columns_kept(tmp_path):
    grpo = read_dataset(_jsonl(tmp_path / "g.jsonl", ROWS[:1]), "grpo")
    assert (grpo.format, grpo.conversational, grpo.rows) == ("prompt", False, ROWS[:1])
    cases = {
        "messages": ([{"messages": MSG}], True),
        "prompt_completion": ([{"prompt": MSG[:1], "completion": MSG[1:]}], True),
        "text": ([{"text": "hello"}], False),
    }
    for fmt, (rows, conv) in cases.items():
        data = read_dataset(_jsonl(tmp_path / f"{fmt}.jsonl", rows), "sft")
        assert (data.format, data.conversational) == (fmt, conv)
    pc = read_dataset(_jsonl(tmp_path / "pc.jsonl", [{"prompt": "a", "completion": "b"}]), "sft")
    assert (pc.format, pc.conversational) == ("prompt_completion", False)
    # DPO's implicit prompt: the shared leading messages become the prompt
    implicit = {"chosen": MSG, "rejected": [MSG[0], {"role": "assistant", "content": "Bye"}]}
    data = read_dataset(_jsonl(tmp_path / "dpo.jsonl", [implicit]), "dpo")
    assert data.rows[0]["prompt"] == MSG[:1] and data.rows[0]["chosen"] == MSG[1:]
    assert data.rows[0]["rejected"] == [{"role": "assistant", "content": "Bye"}]


@pytest.mark.parametrize(
    ("kind", "rows", "message"),
    [
        (
            "grpo",
            [{"prompt": "a"}, {"prompt": "b"}, {"question": "c"}],
            r":3: missing 'prompt' "
            r"\(a GRPO row needs a prompt: string or list of messages\)",
        ),
        (
            "dpo",
            [{"prompt": "p", "chosen": "a", "rejected": "b"}] * 4
            + [{"prompt": "p", "chosen": 3, "rejected": "b"}],
            r":5: 'chosen' must be a string or a list of \{role, content\} messages, got int",
        ),
        (
            "dpo",
            [{"prompt": "p", "chosen": "a", "rejected": "b"}, {"chosen": "a", "rejected": "b"}],
            r":2: missing 'prompt' \(.*only conversational rows may leave it out\)",
        ),
        ("dpo", [{"chosen": MSG, "rejected": MSG[:1]}], r":1: no 'prompt', and 'chosen'"),
        (
            "sft",
            [{"messages": [{"content": "x"}]}],
            r":1: 'messages'\[0\] has no 'role' \(a string",
        ),
        ("sft", [{"messages": [{"role": "user"}]}], r":1: 'messages'\[0\] \(user\) has no "),
        (
            "sft",
            [{"messages": [{"role": "user", "content": 5}]}],
            r":1: 'messages'\[0\]\['content'\] must be a string, got int",
        ),
        ("sft", [{"prompt": "a"}], r":1: missing 'completion'"),
        (
            "sft",
            [{"prompt": "a", "completion": MSG}],
            r":1: 'prompt' and 'completion' must both be strings or both be message lists",
        ),
        ("sft", [{"text": ""}], r":1: 'text' must be a non-empty string, got an empty string"),
        ("sft", [{"question": "a"}], r":1: missing 'messages', 'prompt'\+'completion' or 'text'"),
        (
            "sft",
            [{"text": "a"}, {"messages": MSG}],
            r":2: a messages \(messages\) row in a text \(strings\) dataset \(set by .*:1\)",
        ),
        ("sft", [["not", "an", "object"]], r":1: a row must be a JSON object, got list"),
        (
            "grpo",
            [
                {
                    "prompt": "a",
                    "x": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]],
                }
            ],
            r":1: the row is nested deeper than 32 levels",
        ),
    ],
)
def test_malformed_rows_name_file_and_line(tmp_path, kind, rows, message):
    path = _jsonl(tmp_path / "train.jsonl", rows)
    with pytest.raises(DataError, match=f"^{path}{message}"):
        read_dataset(path, kind)


def test_parquet_errors_name_the_row(tmp_path):
    path = tmp_path / "t.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "a", "n": 1}, {"prompt": None, "n": 2}]), path)
    with pytest.raises(DataError, match=rf"^{path} row 1: missing 'prompt'"):
        read_dataset(path, "grpo")


# -- rows -> tokens -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return write_tiny_tokenizer(tmp_path_factory.mktemp("tok") / "qwen", "qwen2.5")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return write_tiny_tokenizer(tmp_path_factory.mktemp("tok") / "llama", "llama3")


def test_sft_documents_match_transformers(tmp_path, tok_dir):
    hf, tok = AutoTokenizer.from_pretrained(tok_dir), load_tokenizer(tok_dir)
    chat = dict(return_dict=False)
    # conversational prompt/completion: completion = continuation of the full render
    row = {"prompt": MSG[:1], "completion": MSG[1:]}
    data = read_dataset(_jsonl(tmp_path / "pc.jsonl", [row]), "sft")
    docs = sft_documents(data, tok, max_length=512, completion_only_loss=True)
    full = hf.apply_chat_template(MSG, **chat)
    prompt = hf.apply_chat_template(MSG[:1], add_generation_prompt=True, **chat)
    assert docs.sequences[0].tolist() == full
    assert docs.masks[0].tolist() == [0] * len(prompt) + [1] * (len(full) - len(prompt))
    # text: the text and eos (Qwen adds no bos to plain text); every token trains
    data = read_dataset(_jsonl(tmp_path / "t.jsonl", [{"text": "Hello world"}]), "sft")
    docs = sft_documents(data, tok, max_length=512, completion_only_loss=True)
    assert docs.sequences[0].tolist() == hf("Hello world")["input_ids"] + [hf.eos_token_id]
    assert docs.masks[0].all()
    # string prompt/completion, completion-only off: the whole document trains
    data = read_dataset(
        _jsonl(tmp_path / "s.jsonl", [{"prompt": "Q: 1+1=", "completion": "2"}]), "sft"
    )
    docs = sft_documents(data, tok, max_length=512, completion_only_loss=False)
    want = hf("Q: 1+1=")["input_ids"] + hf("2")["input_ids"] + [hf.eos_token_id]
    assert docs.sequences[0].tolist() == want and docs.masks[0].all()


def test_messages_mask_equals_transformers_generation_mask(tmp_path, tok_dir):
    """Independent reference: transformers' ``return_assistant_tokens_mask`` with the template's
    assistant turns wrapped in ``{% generation %}`` tags (content + <|im_end|>)."""
    from hf_fixtures import QWEN25_TEMPLATE

    tagged = QWEN25_TEMPLATE.replace(
        '{%- if (message.role == "user") or (message.role == "system" and not loop.first) or '
        '(message.role == "assistant" and not message.tool_calls) %}\n'
        "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + "
        "'\\n' }}",
        '{%- if message.role == "assistant" and not message.tool_calls %}\n'
        "        {{- '<|im_start|>assistant\\n' }}{% generation %}{{- message.content + "
        "'<|im_end|>' }}{% endgeneration %}{{- '\\n' }}\n"
        '    {%- elif (message.role == "user") or (message.role == "system" and not '
        "loop.first) %}\n"
        "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + "
        "'\\n' }}",
    )
    assert tagged != QWEN25_TEMPLATE
    d = write_tiny_tokenizer(tmp_path / "tagged", "qwen2.5")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = tagged
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    hf, tok = AutoTokenizer.from_pretrained(d), load_tokenizer(d)
    conversation = [
        {"role": "system", "content": "Be brief."},
        *MSG,
        {"role": "user", "content": "What is 12 + 30?"},
        {"role": "assistant", "content": "42"},
    ]
    data = read_dataset(_jsonl(tmp_path / "m.jsonl", [{"messages": conversation}]), "sft")
    docs = sft_documents(data, tok, max_length=512, completion_only_loss=True)
    want = hf.apply_chat_template(conversation, return_assistant_tokens_mask=True)
    assert docs.sequences[0].tolist() == want["input_ids"]
    assert docs.masks[0].astype(int).tolist() == want["assistant_masks"]
    assert sum(want["assistant_masks"]) > 4  # both turns, not a vacuous match
    every = sft_documents(data, tok, max_length=512, completion_only_loss=False)
    assert every.sequences[0].tolist() == want["input_ids"] and every.masks[0].all()


def test_llama_text_rows_start_with_bos(tmp_path, llama_dir):
    hf, tok = AutoTokenizer.from_pretrained(llama_dir), load_tokenizer(llama_dir)
    data = read_dataset(_jsonl(tmp_path / "t.jsonl", [{"text": "Hello world"}]), "sft")
    docs = sft_documents(data, tok, max_length=512, completion_only_loss=True)
    assert docs.sequences[0].tolist() == hf("Hello world")["input_ids"] + [hf.eos_token_id]
    assert docs.sequences[0][0] == hf.bos_token_id


def test_sft_over_length_rows_are_truncated_or_dropped_and_counted(tmp_path, tok_dir):
    tok = load_tokenizer(tok_dir)
    rows = [
        {"prompt": "short", "completion": "ok"},
        {"prompt": "a bit longer prompt", "completion": "and a long long long completion"},
        {"prompt": "word " * 40, "completion": "late"},  # the prompt alone is over the limit
    ]
    data = read_dataset(_jsonl(tmp_path / "pc.jsonl", rows), "sft")
    full = sft_documents(data, tok, max_length=10_000, completion_only_loss=True)
    limit = len(full.sequences[1]) - 3
    assert len(full.sequences[0]) <= limit < len(full.sequences[2]) - 10
    docs = sft_documents(data, tok, max_length=limit, completion_only_loss=True)
    assert (docs.report.over_length, docs.report.dropped) == (2, 1)
    assert docs.rows == [0, 1]
    np.testing.assert_array_equal(docs.sequences[1], full.sequences[1][:limit])
    np.testing.assert_array_equal(docs.masks[1], full.masks[1][:limit])
    assert docs.report.metrics("train") == {"data/train_over_length": 2, "data/train_dropped": 1}
    assert "2 of 3 train rows exceed sft.max_length" in docs.report.warning(
        "train", "sft.max_length"
    )


def test_dpo_documents_truncate_as_trl_and_count(tmp_path, tok_dir):
    tok = load_tokenizer(tok_dir)
    rows = [
        {"prompt": "Q", "chosen": "yes", "rejected": "no"},
        {"prompt": "a long prompt " * 6, "chosen": "a long answer " * 6, "rejected": "no"},
    ]
    data = read_dataset(_jsonl(tmp_path / "d.jsonl", rows), "dpo")
    docs, report, kept = dpo_documents(data, tok, max_length=40, max_prompt_length=20)
    assert (report.over_length, report.dropped, kept) == (1, 0, [0, 1])
    prompt = tok.encode(rows[1]["prompt"])
    chosen = tok.encode(rows[1]["chosen"]) + [tok.eos_id]
    want = prompt[-20:] + chosen[:20]  # the prompt keeps its end, the response its start
    assert docs.sequences[2].tolist() == want
    assert docs.masks[2].tolist() == [0] * 20 + [1] * 20
    rejected = prompt[-20:] + tok.encode("no") + [tok.eos_id]
    assert docs.sequences[3].tolist() == rejected
    first = len(docs.sequences[0]) + len(docs.sequences[1])
    assert docs.pair_lengths.tolist() == [first, 40 + len(rejected)]
    with pytest.raises(DataError, match=r"d.jsonl:2: the pair has .* > schedule.max_tokens=50"):
        dpo_documents(data, tok, max_length=40, max_prompt_length=20, max_tokens=50)


def test_conversational_dpo_and_grpo_prompts_match_transformers(tmp_path, tok_dir):
    hf, tok = AutoTokenizer.from_pretrained(tok_dir), load_tokenizer(tok_dir)
    chat = dict(return_dict=False)
    bye = [{"role": "assistant", "content": "Bye"}]
    row = {"prompt": MSG[:1], "chosen": MSG[1:], "rejected": bye}
    data = read_dataset(_jsonl(tmp_path / "d.jsonl", [row]), "dpo")
    docs, _, _ = dpo_documents(data, tok, max_length=512)
    assert docs.sequences[0].tolist() == hf.apply_chat_template(MSG, **chat)
    assert docs.sequences[1].tolist() == hf.apply_chat_template(MSG[:1] + bye, **chat)
    prompt = hf.apply_chat_template(MSG[:1], add_generation_prompt=True, **chat)
    assert docs.masks[1].tolist() == [0] * len(prompt) + [1] * (len(docs.masks[1]) - len(prompt))
    text = grpo_prompts(
        read_dataset(_jsonl(tmp_path / "g.jsonl", ROWS[:1]), "grpo"), tok, max_prompt_length=1000
    )
    assert text.ids[0].tolist() == hf(ROWS[0]["prompt"])["input_ids"]
    data = read_dataset(_jsonl(tmp_path / "c.jsonl", ROWS[1:] * 2), "grpo")
    prompts = grpo_prompts(data, tok, max_prompt_length=1000)
    assert prompts.ids[0].tolist() == hf.apply_chat_template(
        ROWS[1]["prompt"], add_generation_prompt=True, **chat
    )
    short = grpo_prompts(data, tok, max_prompt_length=5)
    assert short.report.over_length == 2
    assert short.ids[1].tolist() == prompts.ids[1][-5:].tolist()  # TRL keeps the prompt's end
    with pytest.raises(DataError, match=r"g2.jsonl:2: a prompt \(messages\) row in a prompt "):
        read_dataset(_jsonl(tmp_path / "g2.jsonl", ROWS), "grpo")


def test_conversational_rows_need_a_chat_template(tmp_path, tok_dir):
    d = write_tiny_tokenizer(tmp_path / "plain", "qwen2.5")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    path = _jsonl(tmp_path / "m.jsonl", [{"messages": MSG}])
    with pytest.raises(DataError, match=rf"^{path}:1: .* has no chat template"):
        sft_documents(
            read_dataset(path, "sft"), load_tokenizer(d), max_length=99, completion_only_loss=True
        )


# -- the built-in task through the same reader ----------------------------------------------


@pytest.mark.parametrize("kind", ["sft", "dpo", "grpo"])
def test_built_in_task_rows_read_and_encode_like_the_same_rows_in_a_file(tmp_path, kind):
    task = ArithmeticTask(max_digits=2, seed=1)
    tok = char_tokenizer(task.alphabet)
    built_in = task.dataset(kind, 30, split="eval")
    from_file = read_dataset(
        _jsonl(tmp_path / "rows.jsonl", task.rows(kind, 30, split="eval")), kind
    )
    assert built_in.rows == from_file.rows
    assert (built_in.format, built_in.conversational) == (from_file.format, False)
    assert built_in.where[3] == "arithmetic[eval] row 3" and built_in.split == "eval"
    if kind == "sft":
        a, b = (
            sft_documents(d, tok, max_length=16, completion_only_loss=True)
            for d in (built_in, from_file)
        )
        pairs = [(a.sequences, b.sequences), (a.masks, b.masks)]
        # [bos] prompt answer [eos], the loss on the answer and eos
        for ex, ids, mask in zip(
            task.examples(30, split="eval"), a.sequences, a.masks, strict=True
        ):
            prompt = [tok.bos_id, *tok.encode(ex.prompt)]
            assert ids.tolist() == prompt + tok.encode(ex.answer) + [tok.eos_id]
            assert mask.tolist() == [0] * len(prompt) + [1] * (len(ids) - len(prompt))
    elif kind == "dpo":
        (a, _, _), (b, _, _) = (dpo_documents(d, tok, max_length=16) for d in (built_in, from_file))
        pairs = [(a.sequences, b.sequences), (a.masks, b.masks)]
    else:
        a, b = (grpo_prompts(d, tok, max_prompt_length=512) for d in (built_in, from_file))
        pairs = [(a.ids, b.ids)]
        assert built_in.rows[0]["answer"] == task.examples(1, split="eval")[0].answer
    for xs, ys in pairs:
        for x, y in zip(xs, ys, strict=True):
            assert x.dtype == y.dtype
            np.testing.assert_array_equal(x, y)


def test_built_in_task_rows_over_the_limit_are_truncated_and_counted():
    """One length policy for built-in and users' rows: an SFT document over ``max_length``
    keeps its first tokens; one left with no loss token is dropped; both are counted."""
    task = ArithmeticTask(min_digits=2, max_digits=2, seed=0)
    tok = char_tokenizer(task.alphabet)
    data = task.dataset("sft", 20)
    full = sft_documents(data, tok, max_length=16, completion_only_loss=True)
    docs = sft_documents(data, tok, max_length=8, completion_only_loss=True)  # bos + 6 + 1 answer
    assert docs.report.over_length == 20 and docs.report.dropped == 0
    for short, long in zip(docs.sequences, full.sequences, strict=True):
        np.testing.assert_array_equal(short, long[:8])
    with pytest.raises(DataError, match=r"arithmetic: every row was dropped by sft.max_length=7"):
        sft_documents(data, tok, max_length=7, completion_only_loss=True)
    with pytest.raises(DataError, match=r"arithmetic\[train\] row 0: the pair has"):
        dpo_documents(task.dataset("dpo", 3), tok, max_length=16, max_tokens=10)
