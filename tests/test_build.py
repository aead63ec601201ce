"""Run building (``jaxrl.train.build``): the one mapping from the ``model`` section to a
``ModelConfig``, and the same run built for training and, abstract, for planning."""

from __future__ import annotations

import jax
import pytest
from flax import nnx

from jaxrl.config import ConfigError, load_run_config
from jaxrl.models.hf import save_pretrained
from jaxrl.models.model_config import ModelConfig
from jaxrl.models.transformer import Transformer
from jaxrl.train.build import build_run, model_config
from jaxrl.train.objectives import sft_objective

TINY = "configs/sft_tiny.yaml"


def test_model_init_may_name_the_vocabulary_size():
    cfg = load_run_config(TINY, ["model.init.vocab_size=64"])
    assert model_config(cfg.model, 19).vocab_size == 64  # padded past the tokenizer, as HF does
    assert model_config(load_run_config(TINY).model, 19).vocab_size == 19
    small = load_run_config(TINY, ["model.init.vocab_size=10"])
    with pytest.raises(ConfigError, match=r"model.init.vocab_size=10 .* tokenizer has 19"):
        model_config(small.model, 19)


def test_the_model_sections_run_settings_reach_both_kinds_of_model(tmp_path):
    """``model.init`` and ``model.path`` get the same precision / kernel / layer-stack settings
    from the section, and a path's architecture comes from its config.json."""
    source = ModelConfig.tiny(23, hidden_size=16, intermediate_size=32, num_hidden_layers=1)
    save_pretrained(Transformer(source, rngs=nnx.Rngs(0)), tmp_path / "m")
    sets = [
        "model.param_dtype=bfloat16",
        "optimizer.master_rounding=stochastic",
        "model.dtype=float32",
        "model.fp32_lm_head=true",
        "model.attention_block_size=64",
        "model.scan_layers=true",
        "model.remat=block",
    ]
    fresh = model_config(load_run_config(TINY, sets).model, 19)
    loaded = model_config(load_run_config(TINY, [*sets, f"model.path={tmp_path / 'm'}"]).model, 19)
    for config in (fresh, loaded):
        precision = (config.param_dtype, config.dtype, config.fp32_lm_head)
        assert precision == ("bfloat16", "float32", True)
        layers = (config.attention_block_size, config.scan_layers, config.remat)
        assert layers == (64, True, "block")
    assert (loaded.vocab_size, loaded.hidden_size, loaded.num_hidden_layers) == (23, 16, 1)
    assert fresh.vocab_size == 19 and fresh.hidden_size == 128
    with pytest.raises(ConfigError, match="tokenizer has 30 tokens .* vocabulary of 23"):
        model_config(load_run_config(TINY, [f"model.path={tmp_path / 'm'}"]).model, 30)


def test_an_abstract_run_has_the_shapes_and_shardings_of_the_real_one():
    cfg = load_run_config(TINY, ["mesh.data=2", "mesh.fsdp=4"])
    objective = sft_objective(cfg.sft)
    real = build_run(cfg, 19, objective)
    planned = build_run(cfg, 19, objective, abstract=True)
    assert planned.model_config == real.model_config
    shapes = lambda tree: jax.tree.map(lambda x: (x.shape, x.dtype), tree)  # noqa: E731
    assert shapes(planned.state) == shapes(real.state)
    assert planned.shardings == real.shardings
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(planned.state))
