"""Engine sessions (``generate/session.py``): slots that keep their conversation between calls
draw the tokens a fresh ``generate`` of the whole conversation draws, with its log-probs, for
any slot count and whichever slots sit a turn out (fp32)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from jaxrl.generate.sampler import Sampler, SamplingParams
from jaxrl.models import ModelConfig, Transformer

PAD, N = 0, 8


@pytest.fixture(scope="module")
def sampler():
    config = ModelConfig.tiny(
        64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    sampler = Sampler(
        config, max_new_tokens=N, eos_id=[3, *range(40, 50)], pad_id=PAD, prompt_buckets=(8, 32),
        sampling=SamplingParams(temperature=0.9),
    )  # fmt: skip
    sampler.load_params(Transformer(config, rngs=nnx.Rngs(0)))
    return sampler


def _fresh(sampler, conversation, key, limit):
    """Request 0 of a generate call on the whole conversation (the re-prefill path)."""
    res = sampler.generate([conversation], key, max_tokens=[limit])
    n = int(res.lengths[0])
    return res.tokens[0, :n].tolist(), res.logprobs[0, :n], bool(res.truncated[0])


def test_session_turns_equal_generate_on_the_whole_conversation(sampler):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(4, 40, size=int(rng.integers(2, 9))).tolist() for _ in range(5)]
    convs: list[list[int]] = [[] for _ in prompts]
    session = sampler.session(5, 8 + 3 * (N + 4))
    pending: list = [list(p) for p in prompts]
    key = jax.random.key(5)
    compared = 0
    for turn in range(3):
        run = [i for i in range(5) if pending[i] is not None and not (turn == 1 and i == 2)]
        keys = [jax.random.fold_in(key, 10 * i + turn) for i in range(5)]
        limits = [1 + (i + turn) % N for i in range(5)]
        res = session.generate(
            [pending[i] if i in run else None for i in range(5)],
            [jax.random.fold_in(k, 0) for k in keys],
            max_tokens=limits,
        )
        for i in range(5):
            if i not in run:
                assert res.lengths[i] == 0
                continue
            convs[i] += pending[i]
            want, want_lp, want_cut = _fresh(sampler, convs[i], keys[i], limits[i])
            n = int(res.lengths[i])
            assert res.tokens[i, :n].tolist() == want and bool(res.truncated[i]) == want_cut
            np.testing.assert_allclose(res.logprobs[i, :n], want_lp, atol=2e-5)
            convs[i] += want
            pending[i] = rng.integers(4, 40, size=int(rng.integers(1, 5))).tolist()
            compared += n
        np.testing.assert_array_equal(session.lengths, [len(c) for c in convs])
    assert compared > 20
