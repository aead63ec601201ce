"""A TRL-style reward function in a user file, named in YAML, runs GRPO through the CLI: it gets
TRL's keywords with the dataset's columns in row order; a raising one is named in the error."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from jaxrl.cli import main
from jaxrl.data.tasks import ArithmeticTask
from jaxrl.data.tokenizer import char_tokenizer
from jaxrl.train.run_io.metrics import read_metrics

TINY = [
    "max_steps=2",
    "logging.progress=false",
    "logging.eval_samples=0",
    "warm_start.steps=0",
    "model.init={hidden_size: 32, num_hidden_layers: 1, num_attention_heads: 2, "
    "num_key_value_heads: 1, intermediate_size: 64}",
    "task.train_size=64",
    "task.eval_size=8",
    "schedule.max_tokens=64",
    "optimizer.warmup_steps=0",
    "grpo.max_completion_length=4",
    "grpo.num_generations=4",
    "grpo.per_device_train_batch_size=8",
    "logging.eval_every=0",
]

USER_REWARDS = '''
import json
from pathlib import Path
from pathlib import Path

LOG = Path(__file__).parent / "calls.jsonl"


def spy(prompts, completions, completion_ids, trainer_state, **kwargs):
    """Records what TRL's call convention hands over; rewards the completion's length."""
    rewards = [float(len(c)) for c in completions]
    record = {
        "keys": sorted(["prompts", "completions", "completion_ids", "trainer_state", *kwargs]),
        "prompts": prompts,
        "completions": completions,
        "completion_ids": completion_ids,
        "answer": kwargs["answer"],
        "global_step": trainer_state.global_step,
        "max_steps": trainer_state.max_steps,
        "rewards": rewards,
    }
    with LOG.open("a") as f:
        f.write(json.dumps(record) + "\\n")
    return rewards


def boom(prompts, completions, **kwargs):
    return [1.0 / (len(c) - len(c)) for c in completions]


def hang(prompts, completions, **kwargs):
    import time

    time.sleep(20)  # a grader that never answers (the thread is a daemon: the test goes on)
    return [0.0] * len(completions)
'''


def _config(tmp_path, reward: str) -> str:
    """configs/grpo_tiny.yaml with ``grpo.reward_funcs``, written next to the user's file."""
    (tmp_path / "rewards").mkdir(exist_ok=True)
    (tmp_path / "rewards" / "mine.py").write_text(USER_REWARDS)
    data = yaml.safe_load(Path("configs/grpo_tiny.yaml").read_text())
    data["grpo"]["reward_funcs"] = [f"rewards/mine.py:{reward}", "exact_answer"]
    data["output_dir"] = str(tmp_path / "run")
    path = tmp_path / "grpo.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def _train(config: str) -> int:
    return main(["train", config, *[a for s in TINY for a in ("--set", s)]])


def _answer(prompt: str) -> str:
    """The task's answer, computed here: the sum with its digits reversed."""
    a, b = prompt.rstrip("=").split("+")
    return str(int(a) + int(b))[::-1]


@pytest.mark.slow
def test_a_user_file_reward_gets_trl_keywords_and_columns_in_row_order(tmp_path):
    assert _train(_config(tmp_path, "spy")) == 0  # the path is relative to the YAML's directory
    calls = [json.loads(x) for x in (tmp_path / "rewards" / "calls.jsonl").read_text().splitlines()]
    tok = char_tokenizer(ArithmeticTask().alphabet)
    assert [c["global_step"] for c in calls] == [0, 1] and {c["max_steps"] for c in calls} == {2}
    for call in calls:
        assert call["keys"] == [
            "answer",
            "completion_ids",
            "completions",
            "prompts",
            "trainer_state",
        ]
        prompts, completions, ids = call["prompts"], call["completions"], call["completion_ids"]
        assert len(prompts) == len(completions) == len(ids) == len(call["answer"]) == 8
        assert all(len(set(prompts[k : k + 4])) == 1 for k in (0, 4))  # groups of G = 4
        assert call["answer"] == [_answer(p) for p in prompts]  # the row's own answer
        for text, row in zip(completions, ids, strict=True):
            assert all(isinstance(t, int) for t in row) and 1 <= len(row) <= 4
            assert tok.decode(row) == text
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    for row, call in zip(rows, calls, strict=True):  # S = g = 1: step i trains generation i
        assert row["rewards/spy/mean"] == sum(call["rewards"]) / len(call["rewards"])
        assert "rewards/exact_answer/mean" in row


def test_a_raising_reward_function_is_named_in_the_cli_error(tmp_path, capsys):
    assert _train(_config(tmp_path, "boom")) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("error: reward function 'boom' raised ZeroDivisionError"), err
    assert "rows 0-7 of the generation batch" in err[0]


def test_a_hanging_reward_function_stops_the_run_at_reward_timeout(tmp_path, capsys):
    start = time.monotonic()
    code = main(["train", _config(tmp_path, "hang"), *[a for s in TINY for a in ("--set", s)],
                 "--set", "grpo.reward_timeout=0.5"])  # fmt: skip
    err = capsys.readouterr().err.splitlines()
    assert code == 1 and len(err) == 2, err  # the error and the --debug hint
    assert err[0].startswith(
        "error: reward function 'hang' did not return within grpo.reward_timeout=0.5 s (scoring "
        "rows 0-7 of the generation batch"
    ), err
    assert time.monotonic() - start < 20


def test_external_rewards_must_be_finite_and_of_sane_magnitude(tmp_path):
    import pytest

    from jaxrl.config import load_run_config
    from jaxrl.trainers.grpo import GRPOTrainer

    cfg = load_run_config("configs/grpo_tiny.yaml", [*TINY, f"output_dir={tmp_path}"])
    trainer = GRPOTrainer(cfg)
    prompts, completions, logps = [[1, 2]] * 8, [[3]] * 8, [[-0.5]] * 8
    for bad, match in ((float("inf"), r"rewards\[5\]\[0\] = inf"), (1e31, r"= 1e\+31: \|reward\|")):
        rewards = [0.0] * 5 + [bad] + [0.0] * 2
        with pytest.raises(ValueError, match=match):
            trainer.train_on_rollouts(prompts, completions, logps, rewards)
    with pytest.raises(ValueError, match=r"sampler_logprobs\[2\]\[0\] = 50 is not a log-prob"):
        trainer.train_on_rollouts(prompts, completions, [[-0.5]] * 2 + [[50.0]] * 6, [0.0] * 8)
    trainer.session.close()
