"""Exports generate as jaxrl does: after short SFT, DPO and GRPO runs (the built-in task's
character tokenizer, and a Qwen2.5-style chat template), transformers' greedy ``generate()`` on
``<output_dir>/hf``, given no eos or pad id, returns jaxrl's greedy tokens and stops at the eos
(end-of-turn) token the model emits. Without the export's token ids it would run on to
``max_new_tokens``; without the tokenizer's BOS the prompts would differ."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import pytest
import transformers
from hf_fixtures import write_chat_checkpoint

from jaxrl.config import load_run_config
from jaxrl.generate.sampler import Sampler, SamplingParams
from jaxrl.train.build import build_task
from jaxrl.trainers.dpo import DPOTrainer
from jaxrl.trainers.grpo import GRPOTrainer
from jaxrl.trainers.sft import SFTTrainer

ROOT = Path(__file__).resolve().parents[1]
MAX_NEW = 12  # longer than any completion here: stopping early is the eos id's doing
COMMON = [
    "logging.progress=false",
    "logging.eval_every=0",
    "mesh.data=1",
    "checkpoint.every=0",
    "optimizer.warmup_steps=0",
]
# the built-in task (character tokenizer): 40 steps at a high learning rate learn to end
# answers with eos
CHAR = [
    *COMMON,
    "model.init={hidden_size: 32, num_hidden_layers: 1, num_attention_heads: 2, "
    "num_key_value_heads: 1, intermediate_size: 64}",
    "task.train_size=256",
    "task.eval_size=8",
    "schedule.max_tokens=64",
]
# a tiny Qwen2 checkpoint with a Qwen2.5 chat template, fp32 compute (the greedy tokens of
# jaxrl and torch are compared exactly)
CHAT = [
    *COMMON,
    "model.param_dtype=float32",
    "model.dtype=float32",
    "model.scan_layers=true",
    "model.remat=none",
    "schedule.max_tokens=128",
]
QA = [
    ("What is 12 + 30?", "42"),
    ("What is 9 - 3?", "6"),
    ("What is 2 + 2?", "4"),
    ("Name the capital of France.", "Paris"),
]


def _config(name: str, out: Path, sets: list[str]):
    return load_run_config(str(ROOT / "configs" / name), [*sets, f"output_dir={out}"])


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _user(q: str) -> list[dict]:
    return [{"role": "user", "content": q}]


@pytest.fixture(scope="module")
def sft_char(tmp_path_factory):
    out = tmp_path_factory.mktemp("sft_char")
    sets = [
        *CHAR,
        "max_steps=40",
        "sft.per_device_train_batch_size=32",
        "optimizer.learning_rate=1e-2",
    ]
    trainer = SFTTrainer(_config("sft_tiny.yaml", out, sets))
    trainer.run()
    return trainer


@pytest.fixture(scope="module")
def dpo_char(sft_char, tmp_path_factory):
    """DPO from the SFT export: the exported character tokenizer is loaded back."""
    out = tmp_path_factory.mktemp("dpo_char")
    sets = [
        *CHAR,
        f"model.path={sft_char.session.output_dir / 'hf'}",
        "model.init={}",
        "warm_start.steps=0",
        "max_steps=2",
        "dpo.per_device_train_batch_size=8",
    ]
    trainer = DPOTrainer(_config("dpo_tiny.yaml", out, sets))
    trainer.run()
    return trainer


@pytest.fixture(scope="module")
def sft_chat(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft_chat")
    model = write_chat_checkpoint(root / "qwen", "qwen2.5")
    rows = [{"messages": [*_user(q), {"role": "assistant", "content": a}]} for q, a in QA]
    sets = [
        *CHAT,
        f"model.path={model}",
        f"data.train={_jsonl(root / 'train.jsonl', rows)}",
        "data.eval=null",
        "max_steps=20",
        "sft.per_device_train_batch_size=4",
        "sft.max_length=128",
        "optimizer.learning_rate=1e-2",
    ]
    trainer = SFTTrainer(_config("sft_qwen.yaml", root / "run", sets))
    trainer.run()
    return trainer


@pytest.fixture(scope="module")
def grpo_chat(sft_chat, tmp_path_factory):
    """GRPO from the chat SFT export (its tokenizer and generation config carried on)."""
    root = tmp_path_factory.mktemp("grpo_chat")
    rows = [{"prompt": _user(q), "answer": a} for q, a in QA]
    sets = [
        *CHAT,
        f"model.path={sft_chat.session.output_dir / 'hf'}",
        f"data.train={_jsonl(root / 'train.jsonl', rows)}",
        "data.eval=null",
        "max_steps=1",
        "grpo.num_generations=4",
        "grpo.per_device_train_batch_size=4",
        "grpo.gradient_accumulation_steps=1",
        "grpo.max_prompt_length=96",
        "grpo.max_completion_length=8",
        "grpo.reward_funcs=[exact_answer]",
        "grpo.reward_weights=null",
    ]
    trainer = GRPOTrainer(_config("grpo_gsm8k_qwen.yaml", root / "run", sets))
    trainer.run()
    return trainer


def _jaxrl_greedy(trainer, prompts: list[list[int]]) -> list[list[int]]:
    """The trained model's greedy completions from jaxrl's sampler (eos included)."""
    tok, session = trainer.tokenizer, trainer.session
    sampler = Sampler(
        session.model_config,
        max_new_tokens=MAX_NEW,
        eos_id=tok.eos_id,
        pad_id=tok.pad_id,
        sampling=SamplingParams(temperature=0.0),
    )
    sampler.load_params(session.state.params)
    return [c.tolist() for c in sampler.generate(prompts, jax.random.key(0)).completions()]


def _hf_greedy(export: Path, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy completions of the export, with only what its files say."""
    import torch

    model = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
    out = []
    for ids in prompts:
        x = torch.tensor([ids])
        y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                           max_new_tokens=MAX_NEW)  # fmt: skip
        out.append(y[0, len(ids) :].tolist())
    return out


@pytest.mark.slow
@pytest.mark.parametrize("run", ["sft_char", "dpo_char", "sft_chat", "grpo_chat"])
def test_export_generates_jaxrls_greedy_tokens_and_stops_at_eos(run, request):
    trainer = request.getfixturevalue(run)
    tok, export = trainer.tokenizer, trainer.session.output_dir / "hf"
    hf_tok = transformers.AutoTokenizer.from_pretrained(export)
    if run.endswith("char"):  # plain text: the export's tokenizer adds bos as jaxrl does
        texts = [e.prompt for e in build_task(trainer.cfg).examples(4, split="eval")]
        prompts = [tok.encode(t, add_bos=True) for t in texts]
        assert [hf_tok(t).input_ids for t in texts] == prompts
        assert prompts[0][0] == tok.bos_id
    else:
        chats = [_user(q) for q, _ in QA]
        prompts = [tok.apply_chat_template(c, add_generation_prompt=True) for c in chats]
        hf_prompts = [
            hf_tok.apply_chat_template(c, add_generation_prompt=True, return_dict=True)
            for c in chats
        ]
        assert [p["input_ids"] for p in hf_prompts] == prompts
    ours = _jaxrl_greedy(trainer, prompts)
    assert all(len(c) < MAX_NEW and c[-1] == tok.eos_id for c in ours), ours  # eos is emitted
    assert _hf_greedy(export, prompts) == ours
