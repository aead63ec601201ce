"""Llama / Qwen2 / Qwen3 language models: NNX transformer, LM head, HF checkpoints."""

from jaxrl.models.head import lm_head, token_logprobs
from jaxrl.models.hf import from_pretrained, save_pretrained
from jaxrl.models.model_config import ModelConfig
from jaxrl.models.transformer import Transformer

__all__ = [
    "ModelConfig",
    "Transformer",
    "from_pretrained",
    "lm_head",
    "save_pretrained",
    "token_logprobs",
]
