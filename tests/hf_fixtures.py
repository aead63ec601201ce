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
