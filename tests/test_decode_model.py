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
