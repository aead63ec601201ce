"""Held-out evaluation by generation (greedy and sampled accuracy) and the SFT warm-start target."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from flax import nnx

from jaxrl.config import load_run_config
from jaxrl.data.tokenizer import char_tokenizer
from jaxrl.generate.sampler import SamplingParams
from jaxrl.models.model_config import ModelConfig
from jaxrl.models.transformer import Transformer
from jaxrl.rollout.heldout import HeldoutEvaluator
from jaxrl.train.optimizer import learning_rate_schedule
from jaxrl.train.run_io.metrics import read_metrics
from jaxrl.trainers.sft import SFTTrainer
from jaxrl.trainers.warm_start import SUMMARY, warm_start

TOK = char_tokenizer("0123456789+=")
PROMPTS = ["12+34=", "7+7=", "99+1=", "0+0="]
LOW = "6789"  # a completion is "correct" when its one character is one of these


def _low_digit(prompts, completions, *, answer, **_):
    return [float(c[:1] in LOW and c[:1] != "") for c in completions]


def _peaked_model(seed: int = 0) -> Transformer:
    """A tiny random model whose logits are far from uniform (temperature then matters)."""
    cfg = ModelConfig.tiny(
        TOK.vocab_size,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
    )
    model = Transformer(cfg, rngs=nnx.Rngs(seed))
    graphdef, params = nnx.split(model, nnx.Param)
    params = jax.tree.map(lambda x: x * 40.0 if x.ndim == 2 else x, params)
    return nnx.merge(graphdef, params)


def _reference_probability(model: Transformer, temperature: float) -> np.ndarray:
    """float64 P(first token is a low digit | prompt) from a full forward pass, per prompt."""
    low_ids = [TOK.encode(c)[0] for c in LOW]
    out = []
    for p in PROMPTS:
        ids = np.asarray([TOK.encode(p, add_bos=True)], np.int32)
        z = np.asarray(model(ids)[0, -1], np.float64) / temperature
        prob = np.exp(z - z.max())
        prob /= prob.sum()
        out.append(prob[low_ids].sum())
    return np.asarray(out)


def _evaluator(model, *, k: int, temperature: float, seed: int = 0) -> HeldoutEvaluator:
    return HeldoutEvaluator(
        model.config,
        TOK,
        PROMPTS,
        ["" for _ in PROMPTS],
        max_new_tokens=1,
        sampling=SamplingParams(temperature=temperature),
        samples_per_prompt=k,
        seed=seed,
        reward=_low_digit,
    )


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_sampled_accuracy_is_the_expected_reward_at_the_temperature(temperature):
    model = _peaked_model()
    p = _reference_probability(model, temperature)
    assert 0.05 < p.mean() < 0.95  # neither certain nor impossible: the check can fail
    k = 3000
    res = _evaluator(model, k=k, temperature=temperature)(model)
    assert res.sampled_correct.shape == (len(PROMPTS), k)
    sigma = np.sqrt(p * (1 - p) / k)  # per prompt: a binomial mean
    np.testing.assert_array_less(np.abs(res.sampled_correct.mean(1) - p), 4.5 * sigma + 1e-3)
    assert res.sampled == pytest.approx(res.sampled_correct.mean())
    # a different temperature gives a measurably different expectation
    other = _reference_probability(model, 3 * temperature)
    assert np.abs(other - p).max() > 10 * sigma.max()


def test_greedy_accuracy_is_the_argmax_and_k0_is_greedy_only():
    model = _peaked_model(seed=1)
    low_ids = {TOK.encode(c)[0] for c in LOW}
    want = []
    for prompt in PROMPTS:
        ids = np.asarray([TOK.encode(prompt, add_bos=True)], np.int32)
        want.append(float(int(np.argmax(model(ids)[0, -1])) in low_ids))
    res = _evaluator(model, k=0, temperature=1.0)(nnx.split(model, nnx.Param)[1])
    np.testing.assert_array_equal(res.greedy_correct, want)
    assert res.sampled is None and res.sampled_correct is None
    assert res.metrics() == {"eval/accuracy": pytest.approx(np.mean(want))}


def test_evaluations_share_their_random_bits():
    model = _peaked_model(seed=2)
    ev = _evaluator(model, k=64, temperature=1.0)
    a, b = ev(model), ev(model)
    np.testing.assert_array_equal(a.sampled_correct, b.sampled_correct)
    c = _evaluator(model, k=64, temperature=1.0, seed=5)(model)
    assert not np.array_equal(a.sampled_correct, c.sampled_correct)
    assert set(a.metrics("_start")) == {"eval/accuracy_start", "eval/accuracy_sampled_start"}


def _length(prompts, completions, *, answer, parity, completion_ids, **_):
    """A reward reading a held-out column and the completion ids: the row's parity column plus
    the completion's token count (a second function beside ``_low_digit``)."""
    return [p + len(ids) for p, ids in zip(parity, completion_ids, strict=True)]


def test_eval_rewards_score_the_same_completions_with_the_run_s_functions():
    """``logging.eval_rewards``: the run's reward functions score the evaluated completions.
    With ``_low_digit`` as both the accuracy reward and a run reward, eval/reward equals
    eval/accuracy (greedy and sampled); the weighted sum is the training reward's; the accuracy
    itself does not change (the same random bits); without answers only the rewards remain."""
    model = _peaked_model(seed=3)
    k = 64  # as test_evaluations_share_their_random_bits: the same compiled sampler programs
    plain_ev = _evaluator(model, k=k, temperature=1.0)
    plain = plain_ev(model)
    assert not any("reward" in key for key in plain.metrics())  # off: accuracy only
    parity = [i % 2 for i in range(len(PROMPTS))]
    kwargs = dict(
        max_new_tokens=1, sampling=SamplingParams(temperature=1.0), samples_per_prompt=k,
        reward=_low_digit, reward_funcs=[_low_digit, _length], reward_weights=[1.0, 0.5],
        columns={"parity": parity, "answer": [""] * len(PROMPTS)},  # the rows' columns
        sampler=plain_ev.sampler,  # one sampler (its compiled programs) for the three
    )  # fmt: skip
    ev = HeldoutEvaluator(model.config, TOK, PROMPTS, [""] * len(PROMPTS), **kwargs)
    res = ev(model)
    np.testing.assert_array_equal(res.greedy_correct, plain.greedy_correct)
    np.testing.assert_array_equal(res.sampled_correct, plain.sampled_correct)
    m = res.metrics()
    assert m["eval/rewards/_low_digit/mean"] == pytest.approx(m["eval/accuracy"])
    assert m["eval/rewards/_low_digit/mean_sampled"] == pytest.approx(m["eval/accuracy_sampled"])
    assert m["eval/rewards/_length/mean"] == pytest.approx(np.mean(parity) + 1)  # 1 token each
    sampled_parity = np.repeat(parity, k)  # k samples per prompt, in prompt order
    assert m["eval/rewards/_length/mean_sampled"] == pytest.approx(sampled_parity.mean() + 1)
    want = np.mean(res.greedy_correct + 0.5 * (np.asarray(parity) + 1))
    assert m["eval/reward"] == pytest.approx(want)
    want = np.mean(res.sampled_correct.reshape(-1) + 0.5 * (sampled_parity + 1))
    assert m["eval/reward_sampled"] == pytest.approx(want)
    rewards_only = HeldoutEvaluator(model.config, TOK, PROMPTS, None, **kwargs)(model)
    assert rewards_only.metrics() == {k: v for k, v in m.items() if "accuracy" not in k}
    with pytest.raises(ValueError, match="give answers, reward_funcs, or both"):
        HeldoutEvaluator(model.config, TOK, PROMPTS, None, max_new_tokens=1,
                         sampling=SamplingParams(), samples_per_prompt=0)  # fmt: skip


def test_eval_rewards_is_a_logging_key():
    assert load_run_config(
        "configs/grpo_tiny.yaml", ["logging.eval_rewards=true"]
    ).logging.eval_rewards
    with pytest.raises(ValueError, match="logging.eval_rewards"):
        load_run_config("configs/grpo_tiny.yaml", ["logging.eval_rewards=3"])


def test_evaluator_rejects_mismatched_answers():
    model = _peaked_model()
    with pytest.raises(ValueError, match="one answer per prompt"):
        HeldoutEvaluator(
            model.config,
            TOK,
            PROMPTS,
            ["1"],
            max_new_tokens=1,
            sampling=SamplingParams(),
            samples_per_prompt=1,
        )


# -- the SFT warm start's accuracy target ----------------------------------------------------

TINY_SFT = [
    "logging.progress=false",
    "model.init={hidden_size: 32, num_hidden_layers: 1, num_attention_heads: 2, "
    "num_key_value_heads: 1, intermediate_size: 64}",
    "task.train_size=256",
    "task.eval_size=16",
    "sft.per_device_train_batch_size=16",
    "logging.eval_every=2",
    "checkpoint.every=0",
]


def _scripted(monkeypatch, accuracies):
    """SFTTrainer.evaluate returns the scripted accuracies in turn (held-out quality on cue)."""
    seq = iter(accuracies)
    monkeypatch.setattr(SFTTrainer, "evaluate", lambda self: {"eval/accuracy": next(seq)})


def test_sft_stops_at_the_first_eval_reaching_the_target(tmp_path, monkeypatch):
    _scripted(monkeypatch, [0.1, 0.3, 0.55, 0.9, 0.95])
    out = tmp_path / "sft"
    cfg = load_run_config("configs/sft_tiny.yaml", [*TINY_SFT, "max_steps=10", f"output_dir={out}"])
    summary = SFTTrainer(cfg, stop_at_accuracy=0.5).run()
    assert summary["steps"] == 6 and summary["stopped_at_target"]
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert rows[-1]["eval/accuracy"] == 0.55
    # the learning rate follows the schedule of the cap (max_steps), not of the stop
    lr = learning_rate_schedule(cfg.optimizer, cfg.max_steps)
    for r in rows:
        assert r["learning_rate"] == pytest.approx(float(lr(r["step"] - 1)), rel=1e-6)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["6"]  # saved at the stop


def test_warm_start_target_in_a_grpo_config(tmp_path, monkeypatch, capsys):
    _scripted(monkeypatch, [0.2, 0.45, 0.7, 0.8])
    sets = [*TINY_SFT, f"output_dir={tmp_path / 'run'}", "warm_start.steps=20"]
    sets += ["logging.eval_every=7", "warm_start.eval_every=2"]  # the warm start checks every 2
    cfg = load_run_config("configs/grpo_tiny.yaml", [*sets, "warm_start.target=0.6"])
    started = warm_start(cfg)
    assert started.model.path == str(tmp_path / "run" / "sft" / "hf")
    assert not started.warm_starts and started.warm_start.target == 0.6  # done: steps 0
    record = json.loads((tmp_path / "run" / "sft" / SUMMARY).read_text())
    assert record["steps"] == 6 and record["stopped_at_target"] and record["target"] == 0.6
    out = capsys.readouterr().out
    assert "warning" not in out
    line = "SFT warm start reached its target at step 6 of at most 20: held-out accuracy 0.700"
    assert line in out and str(tmp_path / "run" / "sft" / SUMMARY) in out


def test_warm_start_target_not_reached_runs_to_the_cap_and_says_so(tmp_path, monkeypatch, capsys):
    _scripted(monkeypatch, [0.1, 0.2, 0.3])
    sets = [*TINY_SFT, f"output_dir={tmp_path / 'run'}", "warm_start.steps=6"]
    sets += ["warm_start.eval_every=2"]
    cfg = load_run_config("configs/grpo_tiny.yaml", [*sets, "warm_start.target=0.9"])
    warm_start(cfg)
    record = json.loads((tmp_path / "run" / "sft" / SUMMARY).read_text())
    assert record["steps"] == 6 and not record["stopped_at_target"]
    assert "warm_start.target=0.9" in capsys.readouterr().out


def test_warm_start_target_is_validated():
    with pytest.raises(ValueError, match="warm_start.eval_every=0"):
        load_run_config("configs/grpo_tiny.yaml", ["warm_start.eval_every=0"])
    with pytest.raises(ValueError, match="warm_start.target=1.5"):
        load_run_config("configs/grpo_tiny.yaml", ["warm_start.target=1.5"])
