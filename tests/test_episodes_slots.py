"""Tool episodes in the engine's slots (issue 30 item 5): episodes run in an engine session (one
engine call per turn, the environment's tokens appended to live slots) equal the re-sending path
(one ``generate`` of the whole conversation per episode and turn) token for token: completions,
masks, messages; log-probs to fp32 rounding."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from episode_fixtures import AlwaysCall, Resend
from flax import nnx

from jaxrl.data.tool_task import CalculatorTask, calc
from jaxrl.generate.sampler import Sampler, SamplingParams
from jaxrl.models.model_config import ModelConfig
from jaxrl.models.transformer import Transformer
from jaxrl.rollout.episodes import EpisodeRunner
from jaxrl.rollout.tools.toolbox import Toolbox

TASK = CalculatorTask()
TOK = TASK.tokenizer()


class Counting(Sampler):
    sessions = 0

    def session(self, slots, max_length):
        self.sessions += 1
        return super().session(slots, max_length)


def test_episodes_in_slots_equal_resending_the_conversation():
    config = ModelConfig.tiny(
        TOK.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    sampler = Counting(
        config, max_new_tokens=8, eos_id=[TOK.eos_id, *range(4, 44)], pad_id=TOK.pad_id,
        sampling=SamplingParams(temperature=0.7),
    )  # fmt: skip
    sampler.load_params(Transformer(config, rngs=nnx.Rngs(0)))
    runner = EpisodeRunner(
        TOK, Toolbox([calc], parser=AlwaysCall()), max_turns=3, max_completion_length=14
    )
    problems = [r["prompt"] for r in TASK.rows("grpo", 12)]
    rows = [{"answer": "0"} for _ in problems]
    ids = [np.asarray(TOK.apply_chat_template(p), np.int32) for p in problems]
    key = jax.random.key(3)
    resend = Resend(sampler)
    want = runner.run(resend, ids, problems, rows, key)
    got = runner.run(sampler, ids, problems, rows, key)
    assert sampler.sessions == 1 and resend.calls == sum(e.turns for e in want)
    assert sum(e.turns >= 2 for e in want) >= 3, [e.turns for e in want]
    assert any(e.truncated for e in want), [len(e.tokens) for e in want]
    for a, b in zip(got, want, strict=True):
        assert a.tokens == b.tokens and a.mask == b.mask and a.messages == b.messages
        assert (a.turns, a.tool_calls, a.truncated) == (b.turns, b.tool_calls, b.truncated)
        np.testing.assert_allclose(a.logps, b.logps, atol=2e-5)


@pytest.mark.slow
def test_moe_episodes_record_the_routes_of_their_whole_sequence():
    """A MoE model's tool episodes carry their routes (router replay, docs/moe.md): in the
    engine's slots, every token of prompt + completion (model and environment tokens) has the
    experts a teacher-forced forward of the whole sequence picks; re-sending the conversation
    gives the same routes (its last token, unless a cut left it inside, is never fed: -1)."""
    config = ModelConfig.tiny(
        TOK.vocab_size, model_type="qwen3_moe", hidden_size=32, intermediate_size=64,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16,
    )  # fmt: skip
    sampler = Sampler(
        config, max_new_tokens=8, eos_id=[TOK.eos_id, *range(4, 44)], pad_id=TOK.pad_id,
        sampling=SamplingParams(temperature=0.7),
    )  # fmt: skip
    model = Transformer(config, rngs=nnx.Rngs(0))
    sampler.load_params(model)
    runner = EpisodeRunner(
        TOK, Toolbox([calc], parser=AlwaysCall()), max_turns=3, max_completion_length=14
    )
    problems = [r["prompt"] for r in TASK.rows("grpo", 6)]
    rows = [{"answer": "0"} for _ in problems]
    ids = [np.asarray(TOK.apply_chat_template(p), np.int32) for p in problems]
    key = jax.random.key(3)
    got = runner.sample(sampler, ids, problems, {"answer": ["0"] * 6}, key)
    want = runner.run(Resend(sampler), ids, problems, rows, key)
    assert any(e.turns >= 2 for e in want), [e.turns for e in want]
    for p, c, routes, again in zip(ids, got.completions, got.routes, want, strict=True):
        seq = np.concatenate([p, c])
        assert routes.shape == (len(seq), 1, 2)
        _, trace = model.routed_hidden_states(seq[None])
        np.testing.assert_array_equal(routes, np.asarray(trace.routes_BTLK)[0])
        resent = np.concatenate(again.routes)
        np.testing.assert_array_equal(resent[:-1], routes[:-1])
        last = resent[-1]  # -1 unless the turn was cut (tokens generated past it)
        assert (last == -1).all() or (last == routes[-1]).all()
