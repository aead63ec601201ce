"""The shipped real-model configs (configs/*_qwen.yaml) run end to end, unchanged but for
``--set`` overrides that point them at a tiny random Qwen2 checkpoint with a Qwen2.5-style chat
template and at small JSONL files written here (conversational and plain). metrics.jsonl and the
TensorBoard events are written and agree; a TRL-style reward function in a user file receives the
dataset's extra columns in the order of the completions."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hf_fixtures import write_chat_checkpoint
from test_log_sinks import assert_events_match_jsonl

from jaxrl.cli import main
from jaxrl.train.run_io.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
QA = [
    ("What is 12 + 30?", "42"),
    ("What is 7 times 6?", "#### 42"),
    ("Name the capital of France.", "Paris"),
    ("Solve 1 + 1.", "The answer is \\boxed{2}."),
    ("What is 9 - 3?", "6"),
    ("What is 2 + 2?", "4"),
    ("What is 10 / 5?", "2"),
    ("What is 3 * 3?", "9"),
]
SMALL = [
    "logging.progress=false",
    "max_steps=2",
    "mesh.data=2",
    "model.param_dtype=float32",
    "checkpoint.every=1",
    "logging.eval_every=2",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_chat_checkpoint(tmp_path_factory.mktemp("model") / "qwen", "qwen2.5")


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _run(config: str, sets: list[str]) -> Path:
    args = ["train", str(ROOT / "configs" / config)]
    for s in [*SMALL, *sets]:
        args += ["--set", s]
    assert main(args) == 0
    out = next(s.split("=", 1)[1] for s in sets if s.startswith("output_dir="))
    return Path(out)


def _check_logs(out: Path) -> list[dict]:
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows if r["step"] > 0] == [1, 2]  # (DPO logs a step-0 eval)
    assert_events_match_jsonl(out)
    return [r for r in rows if r["step"] > 0]


def _messages(q: str, a: str | None = None) -> list[dict]:
    turns = [{"role": "user", "content": q}]
    return turns + ([{"role": "assistant", "content": a}] if a is not None else [])


@pytest.mark.slow
@pytest.mark.parametrize("conversational", [True, False], ids=["messages", "text"])
def test_sft_qwen_config(tmp_path, model_dir, conversational):
    if conversational:
        rows = [{"messages": _messages(q, a)} for q, a in QA]
    else:
        rows = [{"prompt": q, "completion": " " + a} for q, a in QA]
    data = _jsonl(tmp_path / "train.jsonl", rows)
    out = _run(
        "sft_qwen.yaml",
        [
            f"output_dir={tmp_path / 'run'}",
            f"model.path={model_dir}",
            f"data.train={data}",
            f"data.eval={data}",
            "sft.per_device_train_batch_size=2",
            "sft.max_length=96",
            "schedule.max_tokens=128",
        ],
    )
    rows = _check_logs(out)
    assert rows[-1]["eval/loss"] > 0
    assert rows[-1]["eval/accuracy"] == 0.0  # a random model after 2 steps matches no answer


@pytest.mark.slow
@pytest.mark.parametrize("conversational", [True, False], ids=["messages", "text"])
def test_dpo_qwen_config(tmp_path, model_dir, conversational):
    wrap = (lambda t: [{"role": "assistant", "content": t}]) if conversational else (lambda t: t)
    prompt = (lambda q: _messages(q)) if conversational else (lambda q: q)
    rows = [
        {"prompt": prompt(q), "chosen": wrap(a), "rejected": wrap("I do not know.")} for q, a in QA
    ]
    data = _jsonl(tmp_path / "prefs.jsonl", rows)
    out = _run(
        "dpo_qwen.yaml",
        [
            f"output_dir={tmp_path / 'run'}",
            f"model.path={model_dir}",
            f"data.train={data}",
            f"data.eval={data}",
            "dpo.per_device_train_batch_size=2",
            "dpo.gradient_accumulation_steps=1",
            "dpo.max_length=128",
            "dpo.max_prompt_length=96",
            "schedule.max_tokens=512",
        ],
    )
    rows = _check_logs(out)
    # policy == reference at step 1: ln 2, in the config's bf16 compute too (the cached reference
    # is scored by the train step's own forward structure, jaxrl.train.score)
    assert abs(rows[0]["loss"] - math.log(2)) < 1e-4


SPY = """
import json, os

def spy(prompts, completions, completion_ids, answer, question, **kwargs):
    with open(os.environ["JAXRL_SPY"], "a") as f:
        f.write(json.dumps({"prompts": prompts, "completions": completions,
                            "answer": answer, "question": question,
                            "ids": completion_ids}) + "\\n")
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [float(len(t) % 3) for t in texts]
"""


@pytest.mark.slow
@pytest.mark.parametrize("conversational", [True, False], ids=["messages", "text"])
def test_grpo_gsm8k_qwen_config_with_a_user_reward(
    tmp_path, model_dir, monkeypatch, conversational
):
    prompt = _messages if conversational else (lambda q: q)
    rows = [
        {"prompt": prompt(q), "answer": a, "question": q} for q, a in QA
    ]  # conversational or text prompts; `answer` and `question` are extra columns
    data = _jsonl(tmp_path / "gsm.jsonl", rows)
    (tmp_path / "spy.py").write_text(SPY)
    monkeypatch.setenv("JAXRL_SPY", str(tmp_path / "calls.jsonl"))
    funcs = (
        "[exact_answer, {name: format, pattern: '(?s).*'}, "
        f"{{name: length_penalty, soft_punish_cache: 4}}, '{tmp_path / 'spy.py'}:spy']"
    )
    out = _run(
        "grpo_gsm8k_qwen.yaml",
        [
            f"output_dir={tmp_path / 'run'}",
            f"model.path={model_dir}",
            f"data.train={data}",
            f"data.eval={data}",
            f"grpo.reward_funcs={funcs}",
            "grpo.reward_weights=[1.0, 0.1, 1.0, 1.0]",
            "grpo.num_generations=4",
            "grpo.per_device_train_batch_size=4",
            "grpo.gradient_accumulation_steps=1",
            "grpo.max_completion_length=8",
            "grpo.max_prompt_length=48",
            "schedule.max_tokens=64",
            "logging.eval_samples=2",
            "model.scan_layers=true",
        ],
    )
    rows = _check_logs(out)
    assert "rewards/spy/mean" in rows[0] and "eval/accuracy" in rows[-1]
    calls = [json.loads(x) for x in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert len(calls) == 2  # one generation batch per step (8 completions: 2 prompts x 4)
    by_question = {q: a for q, a in QA}
    for call in calls:
        assert len(call["completions"]) == len(call["answer"]) == len(call["ids"]) == 8
        for p, c, a, q in zip(call["prompts"], call["completions"], call["answer"],
                              call["question"], strict=True):  # fmt: skip
            assert p == prompt(q) and by_question[q] == a  # row order matches completions
            if conversational:  # completions as messages, as TRL hands them over
                assert c[0]["role"] == "assistant"
            else:
                assert isinstance(c, str)
