"""Gemma 2, Gemma 3 (text), Mistral and Qwen2 with a sliding window against transformers.

Tiny random-initialised checkpoints written by transformers itself (``hf_fixtures``): fp32
logits within the parity tolerance of test_model_parity.py, unpacked and packed (windows never
cross a document), a window shorter than the sequence (and a check that it matters), the export
round trip, the text tower of a ``Gemma3ForConditionalGeneration`` checkpoint, and greedy
generation from jaxrl's engine equal to transformers' ``generate`` well past the window.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
import transformers
from flax import nnx
from hf_fixtures import hf_logits, random_hf_model

from jaxrl.generate.sampler import Sampler, SamplingParams
from jaxrl.models import (
    LoraSpec,
    ModelConfig,
    from_pretrained,
    save_adapters,
    save_pretrained,
    with_adapters,
)
from jaxrl.models import lora as L
from jaxrl.models.attention.dense import attention
from jaxrl.models.attention.flash import flash_attention
from jaxrl.models.head import token_logprobs
from jaxrl.models.hf import config_from_hf, read_config
from jaxrl.models.slot_kv_cache import decode_attention

TOL = 1e-4  # test_model_parity.py's
TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
SLIDING, FULL = "sliding_attention", "full_attention"
# name -> transformers config; windows of 4-5 tokens, far shorter than the 24-32 token rows
CASES = {
    # head_dim 32 != D / H, query_pre_attn_scalar != head_dim, both soft-caps small enough to bite
    "gemma2": lambda: transformers.Gemma2Config(
        **TINY, num_hidden_layers=2, head_dim=32, query_pre_attn_scalar=24, sliding_window=5,
        attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
    ),
    # two local layers (base 10k) and a global one (base 1M, linear scaling x8)
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **TINY, num_hidden_layers=3, head_dim=32, query_pre_attn_scalar=24, sliding_window=4,
        layer_types=[SLIDING, SLIDING, FULL], rope_scaling={"rope_type": "linear", "factor": 8.0},
        rope_theta=1e6, rope_local_base_freq=1e4,
    ),
    "qwen2_window": lambda: transformers.Qwen2Config(
        **TINY, num_hidden_layers=2, use_sliding_window=True, sliding_window=4, max_window_layers=1
    ),
    "mistral": lambda: transformers.MistralConfig(**TINY, num_hidden_layers=2, sliding_window=4),
}  # fmt: skip


GEMMA3_1B = dict(  # google/gemma-3-1b-it's config.json (transformers v4 format)
    architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=262_144,
    hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
    num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=512,
    sliding_window_pattern=6, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
    rope_scaling=None, max_position_embeddings=32_768, rms_norm_eps=1e-6,
    hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=None,
    attn_logit_softcapping=None,
)  # fmt: skip


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (path, torch model), each saved by transformers."""
    root = tmp_path_factory.mktemp("gemma")
    out = {}
    for name, make in CASES.items():
        model = random_hf_model(make())
        model.save_pretrained(root / name)
        out[name] = (root / name, model)
    return out


@functools.partial(jax.jit, static_argnums=0)
def _apply(graphdef, state, ids, segment_ids):
    return nnx.merge(graphdef, state)(ids, segment_ids=segment_ids)


def _forward(model, ids, segment_ids=None):
    """Jitted logits; compiled once per (architecture, shapes)."""
    return np.asarray(_apply(*nnx.split(model), jnp.asarray(ids), segment_ids))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_logits_match_transformers_unpacked_and_packed(checkpoints, name):
    """Row 0: one 24-token document; row 1: documents of 9, 8 and 5 tokens and 2 of padding
    (each longer than the window): every document's logits equal transformers' on it alone.
    One compiled forward per architecture: Gemma 3 runs the CPU default (flash), the others
    the dense reference (a shorter compile; flash = dense is tested below)."""
    path, hf_model = checkpoints[name]
    model = from_pretrained(path, attention_impl="flash" if name == "gemma3" else "xla")
    assert model.config.sliding_window is not None and model.config.layer_types is not None
    rng = np.random.default_rng(1)
    ids = rng.integers(0, TINY["vocab_size"], (2, 24))
    seg = np.array([[1] * 24, [1] * 9 + [2] * 8 + [3] * 5 + [0] * 2], np.int32)
    logits = _forward(model, ids, jnp.asarray(seg))
    assert np.isfinite(logits).all()
    worst = 0.0
    for row in range(2):
        for s in range(1, seg[row].max() + 1):
            doc = ids[row][seg[row] == s]
            ref = hf_logits(hf_model, doc[None])[0]
            worst = max(worst, float(np.abs(logits[row][seg[row] == s] - ref).max()))
    assert worst <= TOL, f"{name}: max |logit diff| {worst:.2e}"
    if name == "gemma3":  # scanned: windows and RoPE frequencies from per-layer tables
        scanned = from_pretrained(path, attention_impl="flash", scan_layers=True)
        assert scanned.layers.attn.per_layer
        scanned_logits = _forward(scanned, ids, jnp.asarray(seg))
        np.testing.assert_allclose(scanned_logits, logits, atol=TOL)
    # the window is shorter than the row and matters: transformers without it is far off
    wide = type(hf_model)(dataclasses.replace(CASES[name](), sliding_window=1000)).eval()
    wide.load_state_dict(hf_model.state_dict())
    assert np.abs(hf_logits(wide, ids[:1])[0] - logits[0]).max() > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_export_round_trip_loads_in_transformers(checkpoints, name, tmp_path):
    path, hf_model = checkpoints[name]
    model = from_pretrained(path)
    save_pretrained(model, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(back) is type(hf_model)
    ids = np.random.default_rng(3).integers(0, TINY["vocab_size"], (2, 20))
    np.testing.assert_allclose(hf_logits(back, ids), hf_logits(hf_model, ids), atol=1e-6)
    assert read_config(tmp_path / "out") == model.config


@pytest.mark.slow
def test_gemma3_conditional_generation_text_tower(tmp_path):
    """A multimodal checkpoint loads as its text tower; the vision tower is not read."""
    text = dict(TINY, vocab_size=300, num_hidden_layers=2, head_dim=16, query_pre_attn_scalar=16,
                sliding_window=4, sliding_window_pattern=2)  # fmt: skip
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                  num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)  # fmt: skip
    config = transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=299,
        boi_token_index=297, eoi_token_index=298,
    )  # fmt: skip
    torch.manual_seed(0)
    hf_model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for param in hf_model.parameters():
            param.copy_(0.1 * torch.randn_like(param))
    hf_model.save_pretrained(tmp_path)
    model = from_pretrained(tmp_path)
    assert model.config.model_type == "gemma3" and model.config.layer_types == (SLIDING, FULL)
    ids = np.random.default_rng(1).integers(0, 290, (2, 12))
    with torch.no_grad():
        ref = hf_model(input_ids=torch.as_tensor(ids)).logits.numpy()
    assert np.abs(_forward(model, ids) - ref).max() <= TOL


@pytest.mark.slow
def test_engine_greedy_equals_transformers_generate_past_the_window(checkpoints):
    """Gemma 3 (window 4): 40 greedy tokens, so 32+ past the window, token for token, through
    the engine's prefill (KVCache) and slot decode (decode_attention)."""
    path, hf_model = checkpoints["gemma3"]
    model = from_pretrained(path)
    prompts = [[5, 17, 99, 3, 42, 7], [8, 9, 10]]
    n = 40
    sampler = Sampler(
        model.config,
        max_new_tokens=n,
        eos_id=255,
        pad_id=0,
        sampling=SamplingParams(temperature=0.0),
    )
    sampler.load_params(model)
    result = sampler.generate(prompts, jax.random.key(0))
    for row, prompt in enumerate(prompts):
        with torch.no_grad():
            want = hf_model.generate(
                torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=255,
                pad_token_id=0,
            )[0, len(prompt) :].numpy()  # fmt: skip
        assert len(want) == n and len(set(want.tolist())) > 3  # not a degenerate repeat
        np.testing.assert_array_equal(result.tokens[row, : result.lengths[row]], want)


@pytest.mark.slow
def test_lora_on_gemma3_loads_into_peft_with_equal_logits(checkpoints, tmp_path):
    """Adapters on all seven projections (Gemma's target modules are Llama's names): PEFT
    loads the exported adapter onto the transformers model and gives jaxrl's logits."""
    path, _ = checkpoints["gemma3"]
    dense = from_pretrained(path, attention_impl="xla")
    model = with_adapters(dense, LoraSpec(rank=4, alpha=8.0))
    adapters, frozen = L.split_adapters(model)
    leaves, treedef = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.key(3), len(leaves))
    leaves = [0.05 * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves, strict=True)]
    model = nnx.merge(nnx.graphdef(model), jax.tree.unflatten(treedef, leaves), frozen)
    ids = np.random.default_rng(0).integers(0, TINY["vocab_size"], (2, 12))
    seg = jnp.ones(ids.shape, jnp.int32)
    ours = _forward(model, ids, seg)
    assert np.abs(ours - _forward(dense, ids, seg)).max() > 0.1  # the adapters matter
    save_adapters(model, tmp_path / "adapter", base_model=str(path))
    base = transformers.AutoModelForCausalLM.from_pretrained(path).eval()  # PEFT edits it
    loaded = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    np.testing.assert_allclose(hf_logits(loaded, ids), ours, atol=TOL, rtol=0)


def test_flash_and_decode_match_dense_with_softcap_scale_and_window():
    """flash (forward and its custom backward) and the slot decode kernel against the dense
    reference, with every score variant on and documents longer than the window."""
    rng = np.random.default_rng(0)
    b, t, h, k, dh = 2, 24, 4, 2, 8
    q, kk, v = (jnp.asarray(rng.normal(size=(b, t, n, dh)), jnp.float32) for n in (h, k, k))
    seg = jnp.asarray(np.repeat([[1] * 13 + [2] * 8 + [0] * 3], b, 0))
    pos = jnp.asarray(np.concatenate([np.arange(13), np.arange(8), np.zeros(3, int)]))
    pos = jnp.broadcast_to(pos[None], (b, t))
    variant = dict(scale=0.3, softcap=1.5, window=5)

    @jax.jit
    def run(q, kk, v):
        def value_and_grad(fn):
            loss = lambda *a: jnp.sum(jnp.sin(fn(*a, seg, seg, pos, pos)))  # noqa: E731
            return fn(q, kk, v, seg, seg, pos, pos), jax.grad(loss, argnums=(0, 1, 2))(q, kk, v)

        dense = value_and_grad(lambda *a: attention(*a, **variant))
        flash = value_and_grad(lambda *a: flash_attention(*a, block_size=4, **variant))
        no_window = attention(q, kk, v, seg, seg, pos, pos, scale=0.3, softcap=1.5)
        # slot decode: the query at position 10 of document 1 over entries 0..10
        decoded = decode_attention(
            q[:, 10], kk[None, :, :13], v[None, :, :13], jnp.int32(0), jnp.full((b,), 10), 4,
            **variant,
        )  # fmt: skip
        return dense, flash, no_window, decoded

    (out, grads), (flash_out, flash_grads), no_window, decoded = run(q, kk, v)
    np.testing.assert_allclose(flash_out, out, atol=1e-5)
    for got, want in zip(flash_grads, grads, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)
    assert np.abs(no_window - out).max() > 1e-2  # the window is applied
    np.testing.assert_allclose(decoded, out[:, 10], atol=1e-5)


def test_chunked_head_soft_caps_each_chunk_before_log_softmax():
    """token_logprobs with a final soft-cap, chunked, against float64 numpy."""
    rng = np.random.default_rng(0)
    hidden = rng.normal(size=(2, 7, 16)).astype(np.float32)
    kernel = rng.normal(size=(16, 50)).astype(np.float32)
    targets = rng.integers(0, 50, (2, 7))
    args = (jnp.asarray(hidden), jnp.asarray(kernel), jnp.asarray(targets))
    logp, entropy = token_logprobs(*args, fp32=True, temperature=0.7, chunk_size=3, softcap=2.0)
    z = 2.0 * np.tanh(hidden.astype(np.float64) @ kernel / 2.0) / 0.7
    lse = np.log(np.exp(z).sum(-1))
    want = np.take_along_axis(z, targets[..., None], -1)[..., 0] - lse
    np.testing.assert_allclose(logp, want, atol=1e-5)
    p = np.exp(z - lse[..., None])
    np.testing.assert_allclose(entropy, lse - (p * z).sum(-1), atol=1e-5)


def test_real_gemma_configs_and_refusals():
    """The real Gemma 3 1B / Gemma 2 2B config.json (transformers v4 format) map to the
    published layouts; bad settings are refused naming the field."""
    gemma3_1b = GEMMA3_1B
    config = config_from_hf(gemma3_1b)
    assert config.tie_word_embeddings and config.qk_norm  # Gemma 3's defaults
    assert [config.layer_window(i) for i in range(12)] == ([512] * 5 + [None]) * 2
    assert config.layer_rope(0) == (10_000.0, None) and config.layer_rope(5) == (1e6, None)
    assert config.attention_scale == 256**-0.5 and config.final_logit_softcapping is None
    gemma2 = config_from_hf({"architectures": ["Gemma2ForCausalLM"], "num_hidden_layers": 4})
    assert gemma2.layer_types == (SLIDING, FULL) * 2 and gemma2.final_logit_softcapping == 30.0
    assert gemma2.attn_logit_softcapping == 50.0 and gemma2.vocab_size == 256_000
    # Qwen2 without use_sliding_window: no window, whatever sliding_window says
    qwen = dict(architectures=["Qwen2ForCausalLM"], **TINY, num_hidden_layers=2,
                sliding_window=4, max_window_layers=0)  # fmt: skip
    assert config_from_hf(qwen).sliding_window is None
    with pytest.raises(ValueError, match="hidden_act"):
        config_from_hf({**gemma3_1b, "hidden_activation": "relu"})
    with pytest.raises(ValueError, match="bidirectional"):
        config_from_hf({**gemma3_1b, "use_bidirectional_attention": True})
    with pytest.raises(ValueError, match=r"final_logit_softcapping=2\.0.*only gemma"):
        ModelConfig.tiny(64, final_logit_softcapping=2.0)
    with pytest.raises(ValueError, match=r"layer_types.*one entry per layer"):
        ModelConfig.tiny(64, sliding_window=4, layer_types=[SLIDING])
    with pytest.raises(ValueError, match=r"sliding_window=None.*set the window"):
        ModelConfig.tiny(64, layer_types=[SLIDING] * 4)


@pytest.mark.slow
def test_gemma3_loss_and_gradients_do_not_depend_on_the_mesh():
    """A tiny Gemma 3 (a local and a global layer, window 4 shorter than the documents) on the
    sharding rules' placement over (data, fsdp, tensor) = (2, 2, 2): the loss and every
    parameter's gradient equal one device's to 1e-6 (Gemma's extra norms, q/k norms and
    tied head are covered by the rule table)."""
    from jax.sharding import NamedSharding

    from jaxrl.models import Transformer
    from jaxrl.models.sharding import logical_to_spec, state_shardings
    from jaxrl.runtime.mesh import make_mesh

    config = ModelConfig.tiny(
        64, model_type="gemma3", hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, intermediate_size=64, head_dim=16, query_pre_attn_scalar=16,
        sliding_window=4, layer_types=[SLIDING, FULL], rope_local_base_freq=1e4,
        attention_impl="xla",  # a short compile: the windowed flash kernel is checked above
    )  # fmt: skip
    model = Transformer(config, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, 64, (8, 16)))
    seg = jnp.asarray(np.repeat([[1] * 9 + [2] * 5 + [0] * 2], 8, 0))

    def loss(state, ids, seg):
        logits = nnx.merge(graphdef, state)(ids, segment_ids=seg)
        logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        picked = jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
        return -jnp.sum(picked * (seg[:, 1:] > 0)) / jnp.sum(seg[:, 1:] > 0)

    value_and_grad = jax.jit(jax.value_and_grad(loss))
    want, want_grads = value_and_grad(state, ids, seg)
    mesh = make_mesh(2, 2, 2)
    placed = jax.device_put(state, state_shardings(state, mesh))
    rows = NamedSharding(mesh, logical_to_spec(("batch", None)))
    got, grads = value_and_grad(placed, jax.device_put(ids, rows), jax.device_put(seg, rows))
    assert placed["embedding"].get_value().addressable_shards[0].data.shape == (16, 32)  # split
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_shipped_gemma3_1b_config_parses_and_plans(tmp_path):
    """configs/grpo_gsm8k_gemma3_1b.yaml with a config.json of Gemma 3 1B's real dimensions:
    it builds, and ``jaxrl memory`` plans it (an AOT compile of the scanned train step)."""
    from jaxrl.config import load_run_config
    from jaxrl.train.run_io.memory import plan_memory

    (tmp_path / "config.json").write_text(json.dumps(GEMMA3_1B))  # no weights: shapes only
    cfg = load_run_config(
        "configs/grpo_gsm8k_gemma3_1b.yaml", [f"model.path={tmp_path}", "mesh.data=8"]
    )
    plan = plan_memory(cfg)
    v, d, f, nl, h, k, dh = 262_144, 1152, 6912, 26, 4, 1, 256
    per_layer = 2 * d * h * dh + 2 * d * k * dh + 3 * d * f + 4 * d + 2 * dh  # 4 norms, q/k norms
    assert plan["num_params"] == v * d + nl * per_layer + d == 999_885_952  # tied head
    assert plan["model"]["num_hidden_layers"] == nl and plan["devices"] == 8
    assert plan["total_bytes"] > plan["params_bytes"] == 4 * plan["num_params"]
    # the engine keeps every layer's full-length cache (no ring buffer for the local layers
    # yet, docs/models.md): 2 (k, v) x 26 layers x 1 kv head x 256 x 2 bytes (bf16) per entry
    assert plan["kv_cache_bytes"] % (2 * nl * k * dh * 2) == 0 < plan["kv_cache_bytes"]
