"""The engine's packed prefill (issue 34 item 3): prompts packed several per row give the logits
and the keys/values of a prefill of each prompt alone, and the sampler's completions with packed
rows are those of one prompt per row, token for token (fp32)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.generate.cache_geometry import PACK_MIN_PROMPTS, prompt_rows
from jaxrl.generate.engine import prefill_prompts, prefill_rows
from jaxrl.generate.sampler import Sampler, SamplingParams
from jaxrl.models import ModelConfig, Transformer

PAD = 0


@pytest.fixture(scope="module")
def tiny():
    config = ModelConfig.tiny(
        64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    return Transformer(config, rngs=nnx.Rngs(0))


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(2, 64, size=int(rng.integers(1, 13))).tolist() for _ in range(n)]


def test_prompt_rows_pack_every_prompt_once_without_overlap():
    lengths = [int(n) for n in np.random.default_rng(1).integers(1, 17, size=40)]
    rows = prompt_rows(lengths, 16)
    assert rows.width in (16, 32, 64) and rows.rows * rows.width < 40 * 16
    taken = np.zeros((rows.rows, rows.width), int)
    for q, n in enumerate(lengths):
        taken[rows.row_Q[q], rows.offset_Q[q] : rows.offset_Q[q] + n] += 1
        assert rows.offset_Q[q] + n <= rows.width
    assert taken.max() == 1 and taken.sum() == sum(lengths)
    few = prompt_rows(lengths[: PACK_MIN_PROMPTS - 1], 16)  # few prompts: one per row
    assert few.width == 16 and (few.offset_Q == 0).all() and (few.row_Q == np.arange(15)).all()
    assert prompt_rows(lengths, 16, pack=False).rows == 48  # batch_bucket(40)
    assert prompt_rows(lengths, 16, ranks=8).rows % 8 == 0


@pytest.mark.parametrize("chunk", [0, 8])
def test_packed_prefill_equals_one_prompt_per_row(tiny, chunk):
    prompts = _prompts(20)
    p = 16
    one_QP = np.full((len(prompts), p), PAD, np.int32)
    lengths_Q = np.asarray([len(x) for x in prompts], np.int32)
    for q, x in enumerate(prompts):
        one_QP[q, : len(x)] = x
    want = prefill_prompts(tiny, jnp.asarray(one_QP), jnp.asarray(lengths_Q), chunk)
    rows = prompt_rows(lengths_Q, p)
    assert rows.rows < len(prompts)  # genuinely packed
    tok, seg, pos = (np.zeros((rows.rows, rows.width), np.int32) for _ in range(3))
    for q, x in enumerate(prompts):
        r, c = rows.row_Q[q], rows.offset_Q[q]
        tok[r, c : c + len(x)], seg[r, c : c + len(x)] = x, q + 1
        pos[r, c : c + len(x)] = np.arange(len(x))
    last = rows.start_Q + lengths_Q - 1
    got = prefill_rows(tiny, tok, seg, pos, jnp.asarray(last), chunk)
    np.testing.assert_allclose(got.logits_QV, want.logits_QV, rtol=1e-5, atol=1e-5)
    for q, x in enumerate(prompts):
        r, c = rows.row_Q[q], rows.offset_Q[q]
        pairs = ((got.cache.keys, want.cache.keys), (got.cache.values, want.cache.values))
        for got_kv, ref in pairs:
            np.testing.assert_allclose(
                got_kv[:, r, c : c + len(x)], ref[:, q, : len(x)], rtol=1e-5, atol=1e-6
            )


def test_packed_sampler_completions_equal_one_prompt_per_row(tiny):
    """20 distinct prompts (x 2 completions), fewer slots than requests, per-request limits:
    packed and unpacked prefill give the same tokens; log-probs to fp32 rounding."""
    prompts = [x for x in _prompts(20, seed=3) for _ in range(2)]
    limits = np.random.default_rng(4).integers(1, 11, size=len(prompts))
    out = {}
    for pack in (True, False):
        sampler = Sampler(
            tiny.config, max_new_tokens=10, eos_id=3, pad_id=PAD, max_slots=8,
            prompt_buckets=16, pack_prompts=pack, prefill_chunk=8,
        )  # fmt: skip
        sampler.load_params(tiny)
        out[pack] = sampler.generate(
            prompts, jax.random.key(7), SamplingParams(temperature=1.0), max_tokens=limits
        )
    a, b = out[True], out[False]
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.lengths, b.lengths)
    np.testing.assert_array_equal(a.truncated, b.truncated)
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    assert (a.lengths > 1).sum() > 10
