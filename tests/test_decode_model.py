"""The engine's decode model (jaxrl/generate/sampler_weights.decode_model): layers unrolled
whatever the trainer's layout, the projection kernels stored in ``matmul_dtype``.

A trainer with stacked layers (``scan_layers``) and one with unrolled layers, same weights, give
the same tokens and log-probs bit for bit, with and without a copy at the weight sync; with bf16
matmul operands the sampler's log-probs are the trainer's own forward's (same operands)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.generate.sampler import Sampler, SamplingParams
from jaxrl.generate.sampler_weights import reads_trainer_arrays
from jaxrl.models.model_config import ModelConfig
from jaxrl.models.transformer import Transformer

PROMPTS = [[5, 9, 3, 17, 2], [7, 7, 11], [5, 9, 3, 17, 2], [30, 1, 4, 4, 8, 12, 6]]


def _generate(model: Transformer, copy: bool, scan_layers: bool = False):
    sampler = Sampler(
        model.config, max_new_tokens=6, eos_id=0, pad_id=0,
        sampling=SamplingParams(temperature=1.0), scan_layers=scan_layers,
    )  # fmt: skip
    sampler.load_params(model, copy=copy)
    return sampler.generate(PROMPTS, jax.random.key(3)), sampler


def test_stacked_trainer_decodes_as_unrolled_bit_for_bit():
    cfg = ModelConfig.tiny(64, dtype="float32", num_hidden_layers=3)
    unrolled = Transformer(cfg, rngs=nnx.Rngs(0))
    scanned = Transformer(dataclasses.replace(cfg, scan_layers=True), rngs=nnx.Rngs(0))
    want, _ = _generate(unrolled, copy=True)
    for copy in (True, False):
        got, sampler = _generate(scanned, copy)
        assert sampler.weights.copied  # stacked -> unrolled is always a copy
        np.testing.assert_array_equal(got.tokens, want.tokens)
        np.testing.assert_array_equal(got.logprobs, want.logprobs)
    _, sampler = _generate(unrolled, copy=False)
    assert not sampler.weights.copied  # the trainer's arrays, read in place
    # rollout.scan_layers: the stacked trainer decodes in its scan, its arrays read in place
    got, sampler = _generate(scanned, copy=False, scan_layers=True)
    assert not sampler.weights.copied and sampler.config.scan_layers
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)
    _, sampler = _generate(unrolled, copy=False, scan_layers=True)
    assert not sampler.config.scan_layers  # nothing to scan: an unrolled trainer's layers
    # the memory planner's rule (jaxrl memory) predicts each of these copies
    for model, scan, copied in (
        (scanned, False, True),
        (scanned, True, False),
        (unrolled, False, False),
    ):
        assert reads_trainer_arrays(model.config, scan_layers=scan) is not copied


def test_bf16_operand_sampler_matches_the_trainers_forward():
    cfg = ModelConfig.tiny(64, dtype="float32", matmul_dtype="bfloat16", scan_layers=True)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    out, sampler = _generate(model, copy=False)
    assert sampler.weights.copied and not reads_trainer_arrays(cfg, scan_layers=True)
    kernel = sampler.weights.params["layers"][0]["mlp"]["gate_kernel"].get_value()
    assert kernel.dtype == jnp.bfloat16
    fp32 = Transformer(ModelConfig.tiny(64, dtype="float32", scan_layers=True), rngs=nnx.Rngs(0))
    for b, prompt in enumerate(PROMPTS):
        n = int(out.lengths[b])
        row = np.asarray(prompt + out.tokens[b, :n].tolist(), np.int32)[None]
        got = out.logprobs[b, :n]
        errs = []
        for trainer in (model, fp32):
            logp = jax.nn.log_softmax(trainer(jnp.asarray(row))[0, len(prompt) - 1 : -1], -1)
            errs.append(np.abs(got - np.asarray(logp)[np.arange(n), row[0, len(prompt) :]]).max())
        assert errs[0] < 2e-5, errs  # the same bf16 operands as the trainer's matmuls
        assert errs[1] > 10 * errs[0], errs  # fp32 matmuls differ by bf16 rounding


def _prefill_hlo_and_logits(model: Transformer):
    from jaxrl.generate.engine import prefill_prompts

    tokens = jnp.asarray([[5, 9, 3, 17, 2, 0, 0, 0], [30, 1, 4, 4, 8, 12, 6, 2]], jnp.int32)
    lengths = jnp.asarray([5, 8], jnp.int32)
    graphdef, params = nnx.split(model)
    run = jax.jit(lambda p: prefill_prompts(nnx.merge(graphdef, p), tokens, lengths, 0).logits_QV)
    return run.lower(params).as_text(), np.asarray(run(params))


def test_prefill_runs_unrolled_layers_in_one_loop():
    """The engine's prefill (engine._prefill) holds the block once in fp32 compute
    (layer_stack.run_blocks(looped=True): a short compile) and gives the unrolled forward's
    next-token logits; in bf16 compute it stays unrolled (where XLA rounds depends on the
    program's structure); blocks of different structures (dense layers between MoE ones) run
    unrolled."""
    layers = 4
    cfg = ModelConfig.tiny(64, dtype="float32", num_hidden_layers=layers)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    hlo, logits = _prefill_hlo_and_logits(model)
    one = dataclasses.replace(cfg, num_hidden_layers=1)
    block = _prefill_hlo_and_logits(Transformer(one, rngs=nnx.Rngs(0)))[0].count("dot_general")
    assert hlo.count("dot_general") == block  # the block once (and the head), as with 1 layer
    # the unrolled forward's last-token logits, from the training path
    tokens = [[5, 9, 3, 17, 2], [30, 1, 4, 4, 8, 12, 6, 2]]
    for q, row in enumerate(tokens):
        want = model(jnp.asarray([row], jnp.int32))[0, -1]
        np.testing.assert_allclose(logits[q], np.asarray(want), rtol=1e-5, atol=1e-5)
    bf16 = dataclasses.replace(cfg, dtype="bfloat16", param_dtype="bfloat16")
    hlo, _ = _prefill_hlo_and_logits(Transformer(bf16, rngs=nnx.Rngs(0)))
    assert hlo.count("dot_general") >= layers * (block - 1)
    mixed = ModelConfig.tiny(
        64, dtype="float32", num_hidden_layers=layers, model_type="qwen3_moe", num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=8, mlp_only_layers=[1],
    )  # fmt: skip
    hlo, _ = _prefill_hlo_and_logits(Transformer(mixed, rngs=nnx.Rngs(0)))
    assert hlo.count("dot_general") >= layers * (block - 1)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_trace_once_traces_the_block_once_and_runs_the_unrolled_program(dtype):
    """run_blocks(trace_once=True), the decode model's unrolled layers: the block is traced
    once (its step sees a traced layer index), its equations inlined once per layer, so the
    program computes exactly what Nl separately traced blocks do, bit for bit, in bf16 too."""
    from jaxrl.models.layer_stack import run_blocks

    layers = 4
    cfg = ModelConfig.tiny(64, dtype=dtype, param_dtype=dtype, num_hidden_layers=layers)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    x_BTD = jax.random.normal(jax.random.key(1), (2, 8, cfg.hidden_size), cfg.dtype)
    seg_BT = jnp.asarray([[1] * 8, [1] * 5 + [2] * 3], jnp.int32)
    pos_BT = jnp.asarray([list(range(8)), list(range(5)) + list(range(3))], jnp.int32)
    seen = []

    def step(block, x_BTD, i, seg_BT, pos_BT):
        seen.append(i)
        return block(x_BTD, seg_BT, pos_BT, None)

    def run(once):
        seen.clear()
        forward = jax.jit(
            lambda x: run_blocks(
                model.layers, step, x, seg_BT, pos_BT, scanned=False, trace_once=once
            )  # fmt: skip
        )
        return np.asarray(forward(x_BTD).astype(jnp.float32)), list(seen)

    once, once_seen = run(True)
    each, each_seen = run(False)
    assert len(once_seen) == 1 and not isinstance(once_seen[0], int)
    assert each_seen == list(range(layers))
    np.testing.assert_array_equal(once, each)
