"""Multi-turn tool episodes (docs/tools.md): environment tokens in the context but out of the
loss (token by token on a scripted episode), the token budget and turn limit, sampler log-probs
equal to a scoring forward of the whole conversation, keys independent of the mesh, and a GRPO
step on multi-turn batches equal on dp=1 and dp=8."""

from __future__ import annotations

import os
import tempfile

import jax
import numpy as np
import pytest
from episode_fixtures import AlwaysCall
from tiny_models import one_layer

from jaxrl.cli import main
from jaxrl.config import load_run_config
from jaxrl.data.tool_task import CalculatorTask, calc
from jaxrl.generate.backend import RolloutBackend
from jaxrl.generate.sampler import Sampler, SampleResult, SamplingParams
from jaxrl.rollout.episodes import EpisodeRunner
from jaxrl.rollout.rollout_queue import RolloutBatch
from jaxrl.rollout.tools.toolbox import Toolbox
from jaxrl.runtime.mesh import make_mesh
from jaxrl.train.run_io.metrics import read_metrics
from jaxrl.train.score import Scorer
from jaxrl.trainers.grpo import GRPOTrainer

if not jax.config.jax_compilation_cache_dir:
    jax.config.update(
        "jax_compilation_cache_dir", os.path.join(tempfile.gettempdir(), "jaxrl-test-jax-cache")
    )
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

TASK = CalculatorTask()
TOK = TASK.tokenizer()
CALL = '<tool_call>{"name":"calc","arguments":{"x":"12*3"}}</tool_call>'


class ScriptedSampler(RolloutBackend):
    """A backend answering one row at a time with each prompt's scripted turns in order (a turn
    without a trailing EOS is cut: no EOS within the sampler's budget); log-prob of the k-th
    generated token is -(k + 1) / 100. No weights, no caches, no sessions (re-sending path)."""

    def __init__(self, script: dict[str, list[str]]):
        self.script = {k: list(v) for k, v in script.items()}
        self.calls: list[list[int]] = []

    def load_params(self, params, *, copy=None, version=None):
        raise AssertionError("a scripted sampler has no weights")

    def memory_bytes(self, num_requests, num_groups, longest_prompt):
        return 0  # nothing on any device

    def generate(self, prompts, key, sampling=None):
        (context,) = prompts
        self.calls.append(list(context))
        text = TOK.decode(context, stop_at_eos=False)
        problem = text[: text.index("=") + 1]
        text = self.script[problem].pop(0)
        stops = text.endswith("<eos>")
        ids = TOK.encode(text.removesuffix("<eos>")) + ([TOK.eos_id] if stops else [])
        n = len(ids)
        return SampleResult(
            tokens=np.asarray([ids], np.int32),
            logprobs=-(np.arange(n, dtype=np.float32)[None] + 1) / 100,
            lengths=np.asarray([n], np.int32),
            truncated=np.asarray([not stops]),
            prompt_lengths=np.asarray([len(context)], np.int32),
            num_steps=n,
        )


def _rows(problems):
    rows = [
        {"prompt": [{"role": "user", "content": p}], "answer": str(eval(p[:-1]))} for p in problems
    ]
    prompts = [r["prompt"] for r in rows]
    ids = [np.asarray(TOK.apply_chat_template(p), np.int32) for p in prompts]
    return rows, prompts, ids


def test_scripted_episode_masks_every_environment_token():
    script = {
        "12*3=": [CALL + "<eos>", "36<eos>"],  # a call, then the answer
        "40+2=": ["42<eos>"],  # answers directly
        "7*7=": [
            '<tool_call>{bad</tool_call><tool_call>{"name":"mul","arguments":{}}</tool_call><eos>',
            "0<eos>",
        ],
        "9*9=": ["81818181"],  # no EOS: cut
    }
    problems = list(script)
    sampler = ScriptedSampler(script)
    runner = EpisodeRunner(TOK, Toolbox([calc]), max_turns=3, max_completion_length=400)
    rows, prompts, ids = _rows(problems)
    batch = runner.sample(
        sampler, ids, prompts, {"answer": [r["answer"] for r in rows]}, jax.random.key(0)
    )

    call_ids = TOK.encode(CALL) + [TOK.eos_id]
    env = TOK.encode("<tool_response>36</tool_response>")
    assert (
        runner.environment_ids(prompts[0], [{"role": "tool", "name": "calc", "content": "36"}])
        == env
    )
    # row 0, token by token: the model's call, the environment's response, the model's answer
    want = call_ids + env + TOK.encode("36") + [TOK.eos_id]
    assert batch.completions[0].tolist() == want
    assert batch.rows.masks[0].tolist() == [1] * len(call_ids) + [0] * len(env) + [1] * 3
    lp = batch.logps[0]
    np.testing.assert_array_equal(
        lp[: len(call_ids)], -(np.arange(len(call_ids), dtype=np.float32) + 1) / 100
    )
    assert not lp[len(call_ids) : len(call_ids) + len(env)].any()
    np.testing.assert_array_equal(lp[-3:], -(np.arange(3, dtype=np.float32) + 1) / 100)
    # the second turn conditioned on prompt + call + environment tokens
    assert sampler.calls[len(problems)] == ids[0].tolist() + call_ids + env
    assert batch.reward_completions[0] == [
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "calc", "arguments": {"x": "12*3"}}}]},
        {"role": "tool", "name": "calc", "content": "36"},
        {"role": "assistant", "content": "36"},
    ]  # fmt: skip
    assert batch.reward_completions[1] == [{"role": "assistant", "content": "42"}]
    # row 2: a malformed block and an unknown tool, both answered with errors and counted
    tool_msgs = batch.reward_completions[2][1:3]
    assert [m["role"] for m in tool_msgs] == ["tool", "tool"]
    assert "unknown tool 'mul'" in tool_msgs[0]["content"]
    assert "not valid JSON" in tool_msgs[1]["content"]
    stats = batch.rows.stats
    assert stats["turns"].tolist() == [2, 1, 2, 1]
    assert stats["tool_calls"].tolist() == [1, 0, 2, 0]
    assert stats["tool_failures"].tolist() == [0, 0, 2, 0]
    assert batch.truncated.tolist() == [False, False, False, True]

    # the documents: prompt 0, model tokens 1, environment tokens 0; truncated rows all 0
    rb = RolloutBatch.build(
        ids, batch.completions, batch.logps, batch.truncated, np.zeros((4, 1)),
        np.ones(4, np.float32), mask_truncated=True, completion_masks=batch.rows.masks,
        episode_stats=batch.rows.stats,
    )  # fmt: skip
    for i in range(4):
        p = len(ids[i])
        mask = rb.loss_masks[i]
        assert not mask[:p].any()
        if i == 3:
            assert not mask.any()
            continue
        np.testing.assert_array_equal(mask[p:], batch.rows.masks[i])
        env_tokens = [t for t, m in zip(rb.sequences[i][p:], mask[p:], strict=True) if m == 0]
        model_tokens = [t for t, m in zip(rb.sequences[i][p:], mask[p:], strict=True) if m == 1]
        assert TOK.decode(env_tokens, stop_at_eos=False).replace("</tool_response>", "").count(
            "<tool_response>"
        ) == (len(tool_msgs) if i == 2 else i == 0)
        assert "<tool_response>" not in TOK.decode(model_tokens, stop_at_eos=False)
    again = RolloutBatch.from_json(rb.to_json())  # checkpoints keep the masks and statistics
    for a, b in zip(again.loss_masks, rb.loss_masks, strict=True):
        np.testing.assert_array_equal(a, b)
    assert again.episode_stats["tool_failures"].tolist() == [0, 0, 2, 0]


def test_token_budget_and_turn_limit_end_episodes():
    long_answer = "1" * 40
    script = {"12*3=": [CALL + "<eos>", long_answer + "<eos>"]}
    rows, prompts, ids = _rows(list(script))
    # the call fits, the answer does not: cut at the budget, truncated
    runner = EpisodeRunner(TOK, Toolbox([calc]), max_turns=3, max_completion_length=60)
    ep = runner.run(ScriptedSampler(script), ids, prompts, rows, jax.random.key(0))[0]
    assert len(ep.tokens) == 60 and ep.truncated and ep.turns == 2 and ep.mask[-1] == 1
    # the tool response would leave no room for a model token: dropped, truncated
    env = TOK.encode("<tool_response>36</tool_response>")
    tight = len(TOK.encode(CALL)) + 1 + len(env)
    runner = EpisodeRunner(TOK, Toolbox([calc]), max_turns=3, max_completion_length=tight)
    ep = runner.run(ScriptedSampler(script), ids, prompts, rows, jax.random.key(0))[0]
    assert ep.truncated and ep.turns == 1 and min(ep.mask) == 1 and len(ep.messages) == 1
    # one turn only: the call is not run
    runner = EpisodeRunner(TOK, Toolbox([calc]), max_turns=1, max_completion_length=120)
    ep = runner.run(ScriptedSampler(script), ids, prompts, rows, jax.random.key(0))[0]
    assert not ep.truncated and ep.turns == 1 and ep.tool_calls == 1 and len(ep.messages) == 1


@pytest.fixture(scope="module")
def tiny_model():
    config, graphdef, params = one_layer(TOK.vocab_size)
    return config, graphdef, params


def _sampled_episodes(tiny_model, mesh):
    """8 episodes of an untrained model that stops a turn on any of 40 ids (so turns end
    often) and whose every turn is read as a call: up to 3 turns with tool tokens between."""
    config, _, params = tiny_model
    sampler = Sampler(
        config,
        max_new_tokens=8,
        eos_id=[TOK.eos_id, *range(4, 44)],
        pad_id=TOK.pad_id,
        sampling=SamplingParams(temperature=0.7),
        mesh=mesh,
    )
    sampler.load_params(params)
    box = Toolbox([calc], parser=AlwaysCall())
    runner = EpisodeRunner(TOK, box, max_turns=3, max_completion_length=40)
    rows, prompts, ids = _rows([r["prompt"][0]["content"] for r in TASK.rows("grpo", 8)])
    return ids, runner.run(sampler, ids, prompts, rows, jax.random.key(3))


def test_sampler_logprobs_equal_a_scoring_forward_of_the_conversation(tiny_model):
    _, graphdef, params = tiny_model
    ids, eps = _sampled_episodes(tiny_model, None)
    assert sum(e.turns >= 2 for e in eps) >= 3  # genuinely multi-turn
    seqs = [np.asarray(list(p) + e.tokens, np.int32) for p, e in zip(ids, eps, strict=True)]
    scored = Scorer(graphdef, row_len=64, temperature=0.7).token_logprobs(params, seqs)
    checked = 0
    for p, e, lp in zip(ids, eps, scored, strict=True):
        mask = np.asarray(e.mask)
        assert (mask == 0).any() or e.turns == 1
        got, want = lp[len(p) :], np.asarray(e.logps)
        np.testing.assert_allclose(got[mask == 1], want[mask == 1], atol=2e-5)
        assert not want[mask == 0].any()  # the environment's tokens: no sampler log-prob
        checked += int(mask.sum())
    assert checked > 20


@pytest.mark.slow
def test_episodes_do_not_depend_on_the_mesh(tiny_model):
    ids, one = _sampled_episodes(tiny_model, None)
    _, eight = _sampled_episodes(tiny_model, make_mesh(8))
    for a, b in zip(one, eight, strict=True):
        assert a.tokens == b.tokens and a.mask == b.mask and a.messages == b.messages
        np.testing.assert_allclose(a.logps, b.logps, atol=1e-6)


FIXTURES = os.path.join(os.path.dirname(__file__), "episode_fixtures.py")
TINY = [
    "logging.progress=false",
    "warm_start.steps=0",
    "model.init={hidden_size: 32, num_hidden_layers: 1, num_attention_heads: 2, "
    "num_key_value_heads: 1, intermediate_size: 64}",
    "task.train_size=64",
    "task.eval_size=8",
    "logging.eval_samples=0",
    "logging.eval_every=0",
    "schedule.max_tokens=64",
    "sft.max_length=32",
    "grpo.max_completion_length=16",
    "grpo.max_turns=3",
    "grpo.num_generations=4",
    "optimizer.warmup_steps=0",
    "optimizer.learning_rate=3.0e-3",
    f"grpo.tool_parser={FIXTURES}:AlwaysCall",
    f"grpo.reward_funcs=[{FIXTURES}:chars_reward]",
]


def _tool_trainer(tmp_path, dp: int) -> GRPOTrainer:
    cfg = load_run_config(
        "configs/grpo_tools_tiny.yaml",
        [*TINY, f"output_dir={tmp_path / f'dp{dp}'}", f"mesh.data={dp}",
         f"grpo.per_device_train_batch_size={8 // dp}",
         f"schedule.max_tokens={64 if dp == 1 else 32}"],
    )  # fmt: skip
    t = GRPOTrainer(cfg)
    t.generator.sampler.eos_ids = (TOK.eos_id, *range(4, 44))  # untrained turns end often
    return t


@pytest.mark.slow
def test_multi_turn_grpo_step_is_equal_on_dp1_and_dp8(tmp_path):
    one, eight = _tool_trainer(tmp_path, 1), _tool_trainer(tmp_path, 8)
    a, b = one.step(), eight.step()
    batch = one.rollouts.batches[0]
    env = sum(
        int((m[p:] == 0).sum()) for m, p in zip(batch.loss_masks, batch.prompt_lengths, strict=True)
    )
    assert env > 0 and a["turns/mean"] > 1.5 and a["reward_std"] > 0  # multi-turn, a signal
    assert a["num_micro_batches"] < b["num_micro_batches"]
    for key in ("loss", "grad_norm", "reward", "tools/calls_per_episode", "turns/mean"):
        np.testing.assert_allclose(b[key], a[key], rtol=1e-4, atol=1e-7)
    # the engine counts model tokens only: num_loss_tokens excludes every environment token
    model_tokens = sum(float(m[1:].sum()) for m in batch.loss_masks)
    assert a["num_loss_tokens"] == b["num_loss_tokens"] == model_tokens


def test_cli_smoke_run_of_the_tool_config(tmp_path):
    out = tmp_path / "cli"
    args = ["train", "configs/grpo_tools_tiny.yaml", "--set", f"output_dir={out}"]
    for o in (*TINY[:3], "warm_start.steps=2", "sft.per_device_train_batch_size=16", "max_steps=2",
              "task.train_size=64", "task.eval_size=8", "logging.eval_every=2",
              "logging.eval_samples=1", "grpo.per_device_train_batch_size=8",
              "grpo.num_generations=4", "grpo.max_completion_length=16",
              "grpo.max_turns=2"):  # fmt: skip
        args += ["--set", o]
    assert main(args) == 0
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("tools/calls_per_episode", "tools/failures", "turns/mean"):
        assert all(key in r for r in rows), key
    assert {"eval/accuracy", "eval/tool_call_rate"} <= set(rows[-1])


class Tally:
    """An environment: a running total per episode, started from the row's ``start`` column."""

    def reset(self, **row):
        self.total = int(row["start"])
        self.prompt = row["prompt"]

    def add(self, n: int) -> int:
        """Add to the total.

        Args:
            n: the amount
        """
        self.total += n
        return self.total

    def get_reward(self) -> float:
        return float(self.total)


def test_environment_episodes_and_timeouts_reach_the_model():
    """An environment per episode, reset with its row; a hung tool and a raising tool answer
    with error messages in the next turn's context; reward functions get the environments."""
    from tool_fixtures import sleepy

    add = lambda n: f'<tool_call>{{"name":"add","arguments":{{"n":{n}}}}}</tool_call><eos>'  # noqa: E731
    script = {
        "1+1=": [add(2), add(3), "done<eos>"],
        "2+2=": [add(5), "done<eos>"],
        "3+3=": ['<tool_call>{"name":"sleepy","arguments":{"seconds":5}}</tool_call><eos>',
                 '<tool_call>{"name":"calc","arguments":{"x":"oops"}}</tool_call><eos>',
                 "done<eos>"],
    }  # fmt: skip
    rows, prompts, ids = _rows(list(script))
    box = Toolbox([calc, sleepy], environment=Tally, timeout=0.2)
    runner = EpisodeRunner(TOK, box, max_turns=3, max_completion_length=400)
    columns = {"answer": [r["answer"] for r in rows], "start": [10, 0, 0]}
    sampler = ScriptedSampler(script)
    batch = runner.sample(sampler, ids, prompts, columns, jax.random.key(0))
    envs = batch.columns["environments"]
    assert [e.total for e in envs] == [15, 5, 0]  # one state per episode, reset from its row
    assert envs[0].prompt == prompts[0]
    (reward,) = box.reward_funcs()  # TRL: get_reward() is a reward function named for the class
    assert reward.__name__ == "Tally" and reward(environments=envs, prompts=prompts) == [15, 5, 0]
    assert [m["content"] for m in batch.reward_completions[0] if m["role"] == "tool"] == [
        "12",
        "15",
    ]
    tools = [m["content"] for m in batch.reward_completions[2] if m["role"] == "tool"]
    assert "did not return within 0.2 s" in tools[0] and "ValueError" in tools[1]
    assert batch.rows.stats["tool_failures"].tolist() == [0, 0, 2]
    # the third turn of row 2 was sampled after both error messages
    last = TOK.decode(sampler.calls[-1], stop_at_eos=False)
    assert last.count("{'error'") == 2 and last.endswith("</tool_response>")
