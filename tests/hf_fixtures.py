"""Tiny random Hugging Face checkpoints, written by transformers itself, for parity tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers

transformers.utils.logging.disable_progress_bar()
transformers.utils.logging.set_verbosity_error()

TINY: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
# original_max_position_embeddings=16 puts most of the 8 frequencies of a 16-wide head into
# the scaled and smoothed bands, so a wrong llama3 formula changes the logits.
LLAMA3_SCALING = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=16,
)
_CONFIGS = {
    "llama": transformers.LlamaConfig,
    "qwen2": transformers.Qwen2Config,
    "qwen3": transformers.Qwen3Config,
}
# name -> (model_type, tied, extra config)
CASES: dict[str, tuple[str, bool, dict[str, Any]]] = {
    "llama": ("llama", False, {}),
    "llama3_rope_tied": ("llama", True, dict(rope_scaling=LLAMA3_SCALING)),
    "qwen2_tied": ("qwen2", True, dict(rope_theta=1_000_000.0)),
    "qwen2": ("qwen2", False, {}),
    "qwen3": ("qwen3", False, dict(head_dim=32)),  # H * Dh = 128 != hidden_size
    "qwen3_tied": ("qwen3", True, {}),
}


def hf_config(model_type: str, *, tied: bool, **extra: Any) -> transformers.PretrainedConfig:
    return _CONFIGS[model_type](**TINY, tie_word_embeddings=tied, **extra)


def random_hf_model(config: transformers.PretrainedConfig, seed: int = 0) -> torch.nn.Module:
    """A float32 model whose every parameter (norm scales and biases included) is random."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.copy_(0.1 * torch.randn_like(param))
    return model


def write_case(case: str, root: Path, *, max_shard_size: str | None = None) -> tuple:
    """Build CASES[case], save it with transformers into ``root``; returns (path, torch model)."""
    model_type, tied, extra = CASES[case]
    model = random_hf_model(hf_config(model_type, tied=tied, **extra))
    path = root / case
    kwargs = {} if max_shard_size is None else dict(max_shard_size=max_shard_size)
    model.save_pretrained(path, **kwargs)
    return path, model


def hf_logits(model: torch.nn.Module, input_ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(input_ids), dtype=torch.long)).logits.numpy()


# -- tiny tokenizers with real chat templates ---------------------------------------------------

# Qwen2.5-Instruct's chat template, verbatim (tokenizer_config.json of Qwen/Qwen2.5-0.5B-Instruct):
# a default system prompt when the conversation has none, and a tools branch.
QWEN25_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""  # noqa: E501

# Llama-3.2-Instruct's chat template, verbatim: bos_token in the text, strftime_now for the
# date, `| trim` on every message, tojson(indent=4) for tools.
LLAMA3_TEMPLATE = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""  # noqa: E501

# name -> (template, special tokens, tokenizer_config.json special-token fields)
CHAT_STYLES: dict[str, tuple[str, list[str], dict[str, Any]]] = {
    "qwen2.5": (
        QWEN25_TEMPLATE,
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        dict(bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>"),
    ),
    "llama3": (
        LLAMA3_TEMPLATE,
        ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>"]
        + ["<|eot_id|>"],
        dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", pad_token="<|end_of_text|>"),
    ),
}
_CORPUS = [
    "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
    "system user assistant tool Cutting Knowledge Date: December 2023 Today Date:",
    "What is the capital of France? The capital of France is Paris.",
    "Solve 12 + 30. The answer is 42. Think step by step, then answer.",
    "Hello! How can I help you today? Thanks, that is all for now.",
]


def tiny_tokenizer(style: str = "qwen2.5", *, template_file: bool = False):
    """``(tokenizers.Tokenizer, tokenizer_config dict)``: a byte-level BPE (any text encodes)
    trained on a few sentences (~300 tokens), with the chat style's special tokens and template.
    ``template_file``: leave ``chat_template`` out of the config (it goes to
    ``chat_template.jinja``, as newer transformers saves it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    template, specials, names = CHAT_STYLES[style]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    bos = names["bos_token"]
    if bos is not None:  # Llama-style: plain text starts with bos
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A",
            pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, tok.token_to_id(bos))],
        )
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        **names,
    }
    if not template_file:
        config["chat_template"] = template
    return tok, config


def write_tiny_tokenizer(
    path: Path, style: str = "qwen2.5", *, template_file: bool = False
) -> Path:
    """Save ``tiny_tokenizer(style)`` into ``path`` (HF layout: tokenizer.json,
    tokenizer_config.json, and chat_template.jinja with ``template_file``); returns ``path``."""
    import json

    tok, config = tiny_tokenizer(style, template_file=template_file)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    if template_file:
        (path / "chat_template.jinja").write_text(CHAT_STYLES[style][0])
    return path


def write_chat_checkpoint(path: Path, style: str = "qwen2.5", seed: int = 0) -> Path:
    """A tiny random Qwen2 checkpoint whose vocabulary fits ``tiny_tokenizer(style)``, saved
    with that tokenizer in the same directory (a model directory as jaxrl reads real ones)."""
    write_tiny_tokenizer(path, style)
    import tokenizers

    vocab = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab_size()
    config = transformers.Qwen2Config(**{**TINY, "vocab_size": vocab}, tie_word_embeddings=True)
    random_hf_model(config, seed).save_pretrained(path)
    return path
