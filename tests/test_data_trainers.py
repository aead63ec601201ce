"""SFT and DPO from ``data.train``/``data.eval`` through ``jaxrl train``: a tiny random Qwen2
checkpoint with a Qwen2.5-style chat tokenizer in the same directory, a few steps each, every
TRL format; what the trainers trained on is checked against the chat template independently."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml
from hf_fixtures import write_chat_checkpoint
from transformers import AutoTokenizer

from jaxrl.cli import main
from jaxrl.config import ConfigError, load_run_config
from jaxrl.train.run_io.metrics import read_metrics

QUIET = ["logging.progress=false"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_chat_checkpoint(tmp_path_factory.mktemp("model") / "qwen", "qwen2.5")


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _config(tmp_path, model_dir, algorithm, **sections):
    cfg = {
        "algorithm": algorithm,
        "output_dir": str(tmp_path / "run"),
        "seed": 0,
        "max_steps": 2,
        "mesh": {"data": 2},
        "schedule": {"max_tokens": 256},
        "model": {"path": str(model_dir)},
        "optimizer": {"learning_rate": 1e-3, "warmup_steps": 0},
        "checkpoint": {"every": 0},
        **sections,
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _train(config, *overrides):
    args = ["train", str(config)]
    for o in (*QUIET, *overrides):
        args += ["--set", o]
    return main(args)


QA = [
    ("What is 12 + 30?", "42"),
    ("What is the capital of France?", "Paris."),
    ("Hello!", "Hello! How can I help you today?"),
    ("Solve 1 + 1.", "2"),
]


def _messages(q, a):
    return [{"role": "user", "content": q}, {"role": "assistant", "content": a}]


SFT_ROWS = {
    "messages": [{"messages": _messages(q, a)} for q, a in QA],
    "prompt_completion": [{"prompt": q, "completion": a} for q, a in QA],
    "conversational_prompt_completion": [
        {"prompt": _messages(q, a)[:1], "completion": _messages(q, a)[1:]} for q, a in QA
    ],
    "text": [{"text": f"{q} {a}"} for q, a in QA],
}


@pytest.mark.slow
@pytest.mark.parametrize("fmt", list(SFT_ROWS))
def test_sft_runs_from_data(tmp_path, model_dir, fmt):
    """The 4 rows are one batch, so both steps train on the whole dataset: the second step's
    loss (after one update) is clearly below the first's, on the same loss tokens."""
    train = _jsonl(tmp_path / "train.jsonl", SFT_ROWS[fmt])
    held = _jsonl(tmp_path / "eval.jsonl", SFT_ROWS[fmt][:2])
    sft = {"per_device_train_batch_size": 2, "max_length": 128}  # 4 a step on 2 ranks
    config = _config(
        tmp_path, model_dir, "sft", data={"train": str(train), "eval": str(held)}, sft=sft
    )
    assert _train(config) == 0
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert steps[0]["data/train_over_length"] == 0 and steps[0]["data/eval_over_length"] == 0
    assert [r["num_documents"] for r in steps] == [4, 4]
    assert [r["documents_seen"] for r in steps] == [4, 8] and steps[-1]["epoch"] == 2.0
    assert steps[0]["num_loss_tokens"] == steps[1]["num_loss_tokens"] > 0
    assert steps[1]["loss"] < steps[0]["loss"] - 0.1  # observed ≈ 0.5–0.7 lower
    assert np.isfinite(steps[-1]["eval/loss"])
    assert steps[-1]["eval/accuracy"] == 0.0  # two steps of a random model match no answer
    # the export carries the chat template: transformers renders with it
    hf = AutoTokenizer.from_pretrained(tmp_path / "run" / "hf")
    assert hf.apply_chat_template(_messages(*QA[0]), tokenize=False).startswith("<|im_start|>")


DPO_ROWS = {
    "strings": [{"prompt": q, "chosen": a, "rejected": a[::-1] + "?"} for q, a in QA],
    "conversational": [
        {
            "prompt": _messages(q, a)[:1],
            "chosen": [{"role": "assistant", "content": a}],
            "rejected": [{"role": "assistant", "content": "I do not know."}],
        }
        for q, a in QA
    ],
    "implicit_prompt": [
        {"chosen": _messages(q, a), "rejected": _messages(q, "I do not know.")} for q, a in QA
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("fmt", list(DPO_ROWS))
def test_dpo_runs_from_data(tmp_path, model_dir, fmt):
    train = _jsonl(tmp_path / "train.jsonl", DPO_ROWS[fmt] * 2)
    held = _jsonl(tmp_path / "eval.jsonl", DPO_ROWS[fmt][:2])
    dpo = {"per_device_train_batch_size": 2, "max_length": 128, "max_prompt_length": 96}
    config = _config(
        tmp_path, model_dir, "dpo", data={"train": str(train), "eval": str(held)}, dpo=dpo
    )
    assert _train(config) == 0
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    start, steps = rows[0], [r for r in rows if "loss" in r]
    assert start["step"] == 0 and start["eval/accuracy"] == 0.0  # the policy is its reference
    assert [r["step"] for r in steps] == [1, 2]
    assert steps[0]["data/train_over_length"] == 0
    assert steps[0]["num_documents"] == 2 * 4  # 2 pairs per rank x 2 ranks, chosen + rejected
    for key in ("rewards/chosen", "rewards/accuracy", "logps/rejected"):
        assert np.isfinite(steps[-1][key])
    assert "eval/accuracy" in steps[-1]
    np.testing.assert_allclose(steps[0]["loss"], np.log(2.0), rtol=1e-4)  # z = 0 at the start


@pytest.mark.slow
def test_over_length_rows_are_counted_in_the_first_row_and_the_summary(tmp_path, model_dir, capsys):
    long = {"prompt": "word " * 200, "chosen": "yes", "rejected": "no"}
    train = _jsonl(tmp_path / "train.jsonl", [*DPO_ROWS["strings"], long])
    dpo = {"per_device_train_batch_size": 1, "max_length": 96, "max_prompt_length": 64}
    config = _config(tmp_path, model_dir, "dpo", data={"train": str(train)}, dpo=dpo)
    assert _train(config, "max_steps=1") == 0
    captured = capsys.readouterr()
    assert "warning: 1 of 5 train rows exceed dpo.max_length=96/max_prompt_length=64" in (
        captured.err
    )
    summary = json.loads(captured.out)
    assert summary["data/train_over_length"] == 1 and summary["data/train_dropped"] == 0
    first = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r][0]
    assert first["data/train_over_length"] == 1


def test_data_and_task_are_alternatives_and_data_needs_a_model(tmp_path, model_dir, capsys):
    train = _jsonl(tmp_path / "train.jsonl", SFT_ROWS["text"])
    both = ["--set", f"data.train={train}", "--set", f"model.path={model_dir}"]
    base = ["train", "configs/sft_tiny.yaml", "--set", f"output_dir={tmp_path / 'x'}"]
    assert main([*base, *both]) == 2  # sft_tiny.yaml has a task section
    assert "task and data.train=" in capsys.readouterr().err
    config = _config(tmp_path, model_dir, "sft", data={"train": str(train)})
    assert _train(config, "model.path=null") == 2
    assert "model.path is required with data.train" in capsys.readouterr().err
    assert _train(config, "data.train=null", "data.eval=x.jsonl") == 2
    assert "data.eval='x.jsonl' is invalid without data.train" in capsys.readouterr().err
    # no data.train: the built-in task is the default
    assert load_run_config(None, []).task is not None
    assert load_run_config(config, []).task is None
    with pytest.raises(ConfigError, match=r"warm_start.steps=5 is invalid with data.train"):
        load_run_config(config, ["algorithm=dpo", "warm_start.steps=5"])
    # GRPO reads data.train too: SFT rows (no prompt) are an error naming the file and line
    assert _train(config, "algorithm=grpo") == 2
    assert "train.jsonl:1: missing 'prompt'" in capsys.readouterr().err


def test_a_bad_row_fails_the_run_naming_file_and_line(tmp_path, model_dir, capsys):
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps(SFT_ROWS["text"][0]) + "\n" + '{"text": 3}\n')
    config = _config(tmp_path, model_dir, "sft", data={"train": str(train)})
    assert _train(config) == 2
    assert f"{train}:2: 'text' must be a non-empty string, got int" in capsys.readouterr().err
