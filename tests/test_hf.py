"""HF checkpoints: save_pretrained round trips through transformers, sharded loading, errors."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from hf_fixtures import (
    CASES,
    LLAMA3_SCALING,
    hf_config,
    hf_logits,
    random_hf_model,
    write_case,
    write_chat_checkpoint,
    write_tiny_tokenizer,
)
from safetensors.numpy import load_file, save_file

from jaxrl.config import load_run_config
from jaxrl.data.tokenizer import char_tokenizer, load_tokenizer
from jaxrl.models import ModelConfig, Transformer, from_pretrained, save_pretrained
from jaxrl.models.hf import config_from_hf, config_to_hf
from jaxrl.trainers.session import Session

IDS = np.random.default_rng(0).integers(0, 256, (2, 16))


@functools.partial(jax.jit, static_argnums=0)
def _apply(graphdef, state, ids):
    return nnx.merge(graphdef, state)(ids)


def _logits(model: Transformer, ids: np.ndarray = IDS) -> np.ndarray:
    """Jitted logits; compiled once per architecture, shared by equal models."""
    return np.asarray(_apply(*nnx.split(model), ids))


def _load_hf(path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.slow
@pytest.mark.parametrize("case", ["llama3_rope_tied", "qwen2", "qwen3_tied"])
def test_save_pretrained_round_trips_through_transformers(case, tmp_path):
    src, hf_model = write_case(case, tmp_path)
    model = from_pretrained(src)
    save_pretrained(model, tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "config.json",
        "model.safetensors",
    ]  # no temporary files left behind
    reloaded = _load_hf(tmp_path / "out")
    diff = np.abs(hf_logits(reloaded, IDS) - hf_logits(hf_model, IDS)).max()
    assert diff == 0.0, f"{case}: transformers logits changed by the round trip: {diff}"
    assert type(reloaded).__name__ == type(hf_model).__name__
    assert reloaded.config.tie_word_embeddings == CASES[case][1]
    np.testing.assert_array_equal(_logits(from_pretrained(tmp_path / "out")), _logits(model))


def test_bf16_model_saves_bf16_tensors_that_transformers_loads(tmp_path):
    src, _ = write_case("qwen2", tmp_path)
    save_pretrained(from_pretrained(src, param_dtype="bfloat16"), tmp_path / "bf16")
    assert json.loads((tmp_path / "bf16/config.json").read_text())["torch_dtype"] == "bfloat16"
    tensors = load_file(tmp_path / "bf16/model.safetensors")
    assert {str(t.dtype) for t in tensors.values()} == {"bfloat16"}
    reloaded = _load_hf(tmp_path / "bf16")  # both sides upcast the bf16 tensors exactly
    diff = np.abs(hf_logits(reloaded, IDS) - _logits(from_pretrained(tmp_path / "bf16"))).max()
    assert diff <= 1e-4, diff


def test_sharded_checkpoint_loads(tmp_path):
    path, hf_model = write_case("qwen3", tmp_path, max_shard_size="100KB")
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("model-*.safetensors"))) > 1
    diff = np.abs(_logits(from_pretrained(path)) - hf_logits(hf_model, IDS)).max()
    assert diff <= 1e-4, diff


def test_config_round_trip_and_legacy_formats():
    config = ModelConfig.tiny(
        300, model_type="llama", head_dim=48, rope_theta=5e5, tie_word_embeddings=False,
        rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=8192),
    )  # fmt: skip
    assert config_from_hf(config_to_hf(config)) == config
    # transformers v5 writes rope_parameters; older files write rope_theta / rope_scaling.
    v5 = hf_config("llama", tied=False, rope_scaling=LLAMA3_SCALING)
    parsed = config_from_hf(v5.to_dict())
    assert parsed.rope_scaling.factor == 8.0 and parsed.rope_theta == 10000.0
    qwen25 = {  # Qwen2.5-0.5B's config.json, abridged
        "architectures": ["Qwen2ForCausalLM"], "hidden_size": 896, "intermediate_size": 4864,
        "max_position_embeddings": 32768, "model_type": "qwen2", "num_attention_heads": 14,
        "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0, "rope_scaling": None, "sliding_window": 32768,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_sliding_window": False,
        "vocab_size": 151936, "hidden_act": "silu",
    }  # fmt: skip
    parsed = config_from_hf(qwen25, param_dtype="bfloat16")
    assert (parsed.head_dim, parsed.rope_theta, parsed.attention_bias) == (64, 1e6, True)
    shapes = nnx.eval_shape(lambda: Transformer(parsed, rngs=nnx.Rngs(0)))
    assert shapes.embedding.shape == (151936, 896)


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["PhiForCausalLM"], "model_type": "phi"})
    )
    with pytest.raises(ValueError, match=r"PhiForCausalLM.*Gemma3ForCausalLM.*LlamaForCausalLM"):
        from_pretrained(tmp_path)
    # a sliding window loads (tests/test_gemma.py checks its logits): from layer 1 on here
    windowed = hf_config("qwen2", tied=False, use_sliding_window=True, sliding_window=8,
                         max_window_layers=1)  # fmt: skip
    config = config_from_hf(windowed.to_dict())
    assert config.sliding_window == 8
    assert config.layer_types == ("full_attention", "sliding_attention")


def test_missing_directory_config_and_weights(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope.*config.json.*model.safetensors"):
        from_pretrained(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match=r"config.json not found"):
        from_pretrained(tmp_path)
    hf_config("llama", tied=True).save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"no model.safetensors.*pytorch_model.bin"):
        from_pretrained(tmp_path)


def test_missing_unexpected_and_misshapen_tensors_are_named(tmp_path):
    path, _ = write_case("qwen2", tmp_path)
    weights = path / "model.safetensors"
    tensors = load_file(weights)
    bias = tensors.pop("model.layers.1.self_attn.k_proj.bias")
    save_file(tensors | {"model.extra.weight": bias}, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing \['model.layers.1.self_attn.k_proj.bias'\]"
                                         r".*unexpected \['model.extra.weight'\]"):  # fmt: skip
        from_pretrained(path)
    tensors["model.layers.1.self_attn.k_proj.bias"] = bias[:-1]
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"k_proj.bias has shape \(31,\), expected \(32,\)"):
        from_pretrained(path)


def test_random_hf_model_randomises_norms_and_biases():
    """Guard for the parity tests: default init (unit norms, zero biases) would hide mix-ups."""
    model = random_hf_model(hf_config("qwen3", tied=False))
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    assert np.std(state["model.layers.0.self_attn.q_norm.weight"]) > 0.05
    assert np.std(state["model.norm.weight"]) > 0.05


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape", [(1, 8, 1), (2, 2, 2)])
def test_from_pretrained_places_each_tensor_on_its_shards(tmp_path, mesh_shape):
    """With a mesh every tensor arrives split by the rule table (each device holds its block),
    equal to the unsharded load; the logits still match transformers."""
    from jaxrl.models.sharding import state_shardings
    from jaxrl.runtime.mesh import make_mesh

    src, hf_model = write_case("qwen2", tmp_path, max_shard_size="20KB")
    mesh = make_mesh(*mesh_shape)
    sharded = from_pretrained(src, mesh=mesh)
    whole = from_pretrained(src)
    want = state_shardings(nnx.state(whole), mesh)
    for (path, got), spec, ref in zip(
        jax.tree_util.tree_leaves_with_path(nnx.state(sharded)),
        jax.tree.leaves(want),
        jax.tree.leaves(nnx.state(whole)),
        strict=True,
    ):
        assert got.sharding == spec, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    emb = nnx.state(sharded)["embedding"].get_value()
    assert emb.addressable_shards[0].data.size < emb.size  # really split
    ids = np.arange(12).reshape(2, 6) % 64
    np.testing.assert_allclose(
        np.asarray(sharded(ids)), hf_logits(hf_model, ids), atol=2e-5, rtol=2e-5
    )


@pytest.mark.parametrize("shard", ["../escape.safetensors", "/etc/passwd"])
def test_an_index_naming_shards_outside_the_directory_is_refused(tmp_path, shard):
    path, _ = write_case("qwen3", tmp_path, max_shard_size="100KB")
    index = path / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    first = next(iter(data["weight_map"]))
    data["weight_map"][first] = shard
    index.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="outside the model directory"):
        from_pretrained(path)


def test_a_malformed_index_is_named(tmp_path):
    path, _ = write_case("qwen3", tmp_path, max_shard_size="100KB")
    (path / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(ValueError, match="is not a safetensors index"):
        from_pretrained(path)


def test_save_pretrained_writes_the_token_ids_transformers_generates_with(tmp_path):
    src, _ = write_case("qwen2", tmp_path)
    generation = {"bos_token_id": 5, "eos_token_id": [7, 3], "pad_token_id": 3, "top_k": 20}
    save_pretrained(from_pretrained(src), tmp_path / "out", generation_config=generation)
    config = json.loads((tmp_path / "out/config.json").read_text())
    assert {k: config.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")} == {
        "bos_token_id": 5,
        "eos_token_id": [7, 3],
        "pad_token_id": 3,
    }
    assert "top_k" not in config  # sampling settings live in generation_config.json only
    assert json.loads((tmp_path / "out/generation_config.json").read_text()) == generation
    reloaded = _load_hf(tmp_path / "out")
    gc = reloaded.generation_config
    assert (gc.bos_token_id, gc.eos_token_id, gc.pad_token_id, gc.top_k) == (5, [7, 3], 3, 20)


def test_tokenizer_generation_config_leads_with_the_sampler_eos(tmp_path):
    """The id jaxrl's sampler stops on comes first; the source's other stop ids follow."""
    assert char_tokenizer("0123456789+=").generation_config() == {
        "eos_token_id": 1,
        "pad_token_id": 0,
        "bos_token_id": 2,
    }
    tok = load_tokenizer(write_tiny_tokenizer(tmp_path, "qwen2.5"))  # eos <|im_end|>
    end, text = tok.eos_id, tok.pad_id  # <|im_end|>, <|endoftext|>
    assert tok.generation_config() == {"eos_token_id": end, "pad_token_id": text}
    instruct = {"bos_token_id": text, "eos_token_id": [end, text], "temperature": 0.7}
    assert tok.generation_config(instruct) == {**instruct, "pad_token_id": text}
    base = {"bos_token_id": text, "eos_token_id": text}  # a base model stops on <|endoftext|>
    assert tok.generation_config(base)["eos_token_id"] == [end, text]


@pytest.fixture(scope="module")
def chat_checkpoint(tmp_path_factory) -> Path:
    """A tiny Qwen2.5-style fp32 checkpoint whose generation_config.json is Instruct-like."""
    path = write_chat_checkpoint(tmp_path_factory.mktemp("chat") / "qwen")
    tok = load_tokenizer(path)
    generation = {
        "bos_token_id": tok.pad_id,
        "eos_token_id": [tok.eos_id, tok.pad_id],
        "pad_token_id": tok.pad_id,
        "do_sample": True,
        "temperature": 0.7,
        "transformers_version": "4.37.0",
    }
    (path / "generation_config.json").write_text(json.dumps(generation))
    return path


def _export(tmp_path: Path, path: Path | None, *sets: str) -> Path:
    """``Session.export`` of a session that has not trained (the model as loaded or built)."""
    model = [f"model.path={path}"] if path else []
    cfg = load_run_config(
        "configs/sft_qwen.yaml" if path else "configs/sft_tiny.yaml",
        [*model, f"output_dir={tmp_path / 'run'}", "mesh.data=1", "model.scan_layers=false",
         "model.remat=none", *sets],
    )  # fmt: skip
    tokenizer = load_tokenizer(path) if path else char_tokenizer("0123456789+=")
    session = Session(cfg, tokenizer.vocab_size, objective=None)
    try:
        return session.export(tokenizer)
    finally:
        session.close()


@pytest.mark.parametrize(
    ("source", "sets", "want"),
    [
        ("float32", ["model.dtype=bfloat16"], "float32"),  # fp32 checkpoint, bf16 compute
        ("float32", ["model.dtype=bfloat16", "export.dtype=bfloat16"], "bfloat16"),
        ("bfloat16", [], "bfloat16"),  # fp32 masters of a bf16 checkpoint go back as bf16
        (None, ["model.dtype=bfloat16"], "float32"),  # a fresh model: model.param_dtype
    ],
)
def test_export_keeps_the_checkpoint_dtype(tmp_path, chat_checkpoint, source, sets, want):
    path = chat_checkpoint if source == "float32" else None
    if source == "bfloat16":  # in transformers v4's key (v5 writes "dtype")
        path = Path(shutil.copytree(chat_checkpoint, tmp_path / "bf16"))
        config = json.loads((path / "config.json").read_text())
        config.pop("dtype")
        (path / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    out = _export(tmp_path, path, "model.param_dtype=float32", *sets)
    assert {str(t.dtype) for t in load_file(out / "model.safetensors").values()} == {want}
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == want
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    assert reloaded.dtype == getattr(torch, want)


def test_export_carries_the_sources_generation_config(tmp_path, chat_checkpoint):
    out = _export(tmp_path, chat_checkpoint)
    tok = load_tokenizer(chat_checkpoint)
    ids = {"bos_token_id": tok.pad_id, "eos_token_id": [tok.eos_id, tok.pad_id]}
    ids["pad_token_id"] = tok.pad_id
    assert json.loads((out / "generation_config.json").read_text()) == {
        **ids,
        "do_sample": True,
        "temperature": 0.7,
    }  # transformers' own version stamp is not carried
    config = json.loads((out / "config.json").read_text())
    assert {k: config[k] for k in ids} == ids
