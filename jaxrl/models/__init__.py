"""Llama / Qwen2 / Qwen3 language models: NNX transformer, LM head, HF checkpoints.

The names below are imported on first use, so ``jaxrl.models.model_config`` (plain data, no jax)
can be read by the config layer without loading jax.
"""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "LoraSpec": "model_config",
    "ModelConfig": "model_config",
    "Transformer": "transformer",
    "from_pretrained": "hf",
    "lm_head": "head",
    "save_adapters": "adapters.peft",
    "save_pretrained": "hf",
    "token_logprobs": "head",
    "with_adapters": "lora",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(f"jaxrl.models.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'jaxrl.models' has no attribute {name!r}")
