"""The tiny model several tests share: one layer, 32 wide, 4 heads over 2 KV heads, seed 0."""

from __future__ import annotations

from typing import Any

from flax import nnx

from jaxrl.models.model_config import ModelConfig
from jaxrl.models.transformer import Transformer


def one_layer(vocab_size: int) -> tuple[ModelConfig, Any, Any]:
    """``(config, graphdef, params)`` of a fresh 1-layer ``ModelConfig.tiny`` model."""
    config = ModelConfig.tiny(
        vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    graphdef, params = nnx.split(Transformer(config, rngs=nnx.Rngs(0)))
    return config, graphdef, params
