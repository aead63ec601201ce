"""``load_tokenizer`` + chat templates: ids equal transformers' ``apply_chat_template`` for the
same directory (Qwen2.5- and Llama-3-Instruct templates on a tiny byte-level BPE), special
tokens and template files read as HF reads them, assistant masks and their errors."""

from __future__ import annotations

import json

import pytest
from hf_fixtures import QWEN25_TEMPLATE, write_tiny_tokenizer
from transformers import AutoTokenizer

import jaxrl.data
from jaxrl.data.chat_template import ChatTemplateError
from jaxrl.data.tokenizer import load_tokenizer

SYSTEM = {"role": "system", "content": "Be brief."}
CONVERSATIONS = {
    "single user turn": [{"role": "user", "content": "What is 12 + 30?"}],
    "system + user": [SYSTEM, {"role": "user", "content": "Hello!"}],
    "multi-turn": [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "  And of Italy?\n\n"},  # whitespace: Llama trims it
        {"role": "assistant", "content": 'Rome, <b>of course</b> & "quoted".'},
    ],
    "system multi-turn": [
        SYSTEM,
        {"role": "user", "content": "Solve 1 + 1."},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "Thanks"},
    ],
    "unicode": [{"role": "user", "content": "Grüße, 世界 🙂 — tab\there"}],
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers <fast> & exact",
            "parameters": {"type": "object", "properties": {"a": {"type": "number"}}},
        },
    }
]


@pytest.fixture(scope="module", params=["qwen2.5", "llama3"])
def style_dir(request, tmp_path_factory):
    return write_tiny_tokenizer(tmp_path_factory.mktemp(request.param) / "tok", request.param)


@pytest.mark.parametrize("name", list(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_ids_equal_transformers(style_dir, name, add_generation_prompt):
    hf = AutoTokenizer.from_pretrained(style_dir)
    ours = jaxrl.data.load_tokenizer(style_dir)
    messages = CONVERSATIONS[name]
    want = hf.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
    )
    assert ours.apply_chat_template(messages, add_generation_prompt) == want
    text = hf.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert ours.render_chat(messages, add_generation_prompt) == text
    assert ours.decode(want, stop_at_eos=False) == hf.decode(want, skip_special_tokens=True)


def test_tools_and_extra_template_kwargs_equal_transformers(style_dir):
    hf = AutoTokenizer.from_pretrained(style_dir)
    ours = load_tokenizer(style_dir)
    messages = CONVERSATIONS["system + user"]
    want = hf.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    assert ours.render_chat(messages, False, tools=TOOLS) == want
    assert "<fast> & exact" in want  # HF's tojson does not escape HTML
    kwargs = dict(date_string="01 Jan 2020")  # Llama's template reads it; Qwen's ignores it
    want = hf.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
    assert ours.apply_chat_template(messages, False, **kwargs) == want


def test_special_tokens_ids_and_bos(style_dir):
    hf = AutoTokenizer.from_pretrained(style_dir)
    ours = load_tokenizer(style_dir)
    assert ours.eos_id == hf.eos_token_id and ours.pad_id == hf.pad_token_id
    assert ours.bos_id == hf.bos_token_id
    assert ours.vocab_size == len(hf)
    # plain text: bos exactly when transformers adds one (Llama yes, Qwen no)
    plain = hf("Hello world")["input_ids"]
    assert ours.encode("Hello world", add_bos=ours.add_bos_token) == plain
    assert ours.add_bos_token == (hf.bos_token_id is not None)


def test_chat_template_file_list_form_and_added_token_dicts(tmp_path):
    # chat_template.jinja (newer transformers) wins over the config's template
    d = write_tiny_tokenizer(tmp_path / "file", "qwen2.5", template_file=True)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{{ 'stale config template' }}"
    # special tokens as AddedToken dicts, as older transformers writes them
    cfg["eos_token"] = {"__type": "AddedToken", "content": "<|im_end|>", "special": True}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    ours, hf = load_tokenizer(d), AutoTokenizer.from_pretrained(d)
    messages = CONVERSATIONS["multi-turn"]
    assert ours.apply_chat_template(messages) == hf.apply_chat_template(
        messages, add_generation_prompt=True, return_dict=False
    )
    assert ours.eos_id == hf.eos_token_id
    # a list of named templates: "default" is used, as transformers does
    d2 = write_tiny_tokenizer(tmp_path / "list", "qwen2.5")
    cfg = json.loads((d2 / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [
        {"name": "rag", "template": "{{ 'not this one' }}"},
        {"name": "default", "template": QWEN25_TEMPLATE},
    ]
    (d2 / "tokenizer_config.json").write_text(json.dumps(cfg))
    ours, hf = load_tokenizer(d2), AutoTokenizer.from_pretrained(d2)
    assert ours.apply_chat_template(messages, False) == hf.apply_chat_template(
        messages, return_dict=False
    )
    # save() writes back what was read: transformers loads the copy with the same template
    ours.save(tmp_path / "copy")
    again = AutoTokenizer.from_pretrained(tmp_path / "copy")
    assert again.apply_chat_template(messages, return_dict=False) == ours.apply_chat_template(
        messages, False
    )


def test_no_chat_template_is_a_clear_error(tmp_path):
    d = write_tiny_tokenizer(tmp_path / "plain", "qwen2.5")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = load_tokenizer(d)
    assert not tok.has_chat_template
    with pytest.raises(ChatTemplateError, match=r"has no chat template .* conversational rows"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_a_template_that_raises_names_its_file(tmp_path):
    d = write_tiny_tokenizer(tmp_path / "strict", "qwen2.5")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{{ raise_exception('roles must alternate') }}"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ChatTemplateError, match=r"tokenizer_config.json .* roles must alternate"):
        load_tokenizer(d).apply_chat_template([{"role": "user", "content": "hi"}])


def _marked_runs(tok, messages):
    """``(ids, mask, runs)``: the conversation's ids and mask, and the maximal runs of marked
    tokens (one per assistant turn when the mask is right)."""
    ids, mask = tok.chat_assistant_mask(messages)
    runs, run = [], []
    for i, m in zip(ids, mask, strict=True):
        if m:
            run.append(i)
        elif run:
            runs.append(run)
            run = []
    if run:
        runs.append(run)
    return ids, mask, runs


def test_assistant_mask_marks_each_assistant_turn_and_its_end_token(style_dir):
    tok = load_tokenizer(style_dir)
    hf = AutoTokenizer.from_pretrained(style_dir)
    messages = CONVERSATIONS["multi-turn"]
    ids, mask, runs = _marked_runs(tok, messages)
    assert ids == hf.apply_chat_template(messages, return_dict=False)
    assistants = [m["content"].strip() for m in messages if m["role"] == "assistant"]
    assert len(runs) == len(assistants)
    for run, content in zip(runs, assistants, strict=True):
        assert run[-1] == tok.eos_id  # the end-of-turn token carries loss
        assert hf.decode(run[:-1]) == content  # exactly the content, nothing of the headers
    assert sum(mask) == sum(len(r) for r in runs)


def test_assistant_mask_rejects_templates_without_the_prefix_property(tmp_path):
    # a template that drops earlier assistant turns (as reasoning templates drop past thoughts)
    d = write_tiny_tokenizer(tmp_path / "lossy", "qwen2.5")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (
        "{% for m in messages %}{% if m.role != 'assistant' or loop.last %}"
        "{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = load_tokenizer(d)
    with pytest.raises(ChatTemplateError, match=r"tokenizer_config.json .* not a token prefix"):
        tok.chat_assistant_mask(CONVERSATIONS["multi-turn"])
    with pytest.raises(ChatTemplateError, match="starts with an assistant turn"):
        tok.chat_assistant_mask([{"role": "assistant", "content": "hi"}])
