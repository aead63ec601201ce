"""GRPO end to end on a tiny model: on-policy ratios, sampler/trainer log-prob agreement, CLI
metric keys, dp=1 vs dp=8 invariance, external rollouts, docs_per_step and exact resume."""

from __future__ import annotations

import numpy as np
import pytest

from jaxrl.cli import main
from jaxrl.config import ConfigError, load_run_config
from jaxrl.train.run_io.metrics import read_metrics, reproducible
from jaxrl.trainers.grpo import PLOT_NAME, GRPOTrainer
from jaxrl.trainers.session import Session

CONFIG = "configs/grpo_tiny.yaml"
TINY = [
    "logging.progress=false",
    "warm_start.steps=0",
    "model.init={hidden_size: 32, num_hidden_layers: 1, num_attention_heads: 2, "
    "num_key_value_heads: 1, intermediate_size: 64}",
    "task.train_size=64",
    "task.eval_size=8",  # = the generation batch: eval and generation share one sampler program
    "schedule.max_tokens=64",
    "optimizer.warmup_steps=0",
    "optimizer.learning_rate=3.0e-2",
    "grpo.max_completion_length=4",
    "grpo.num_generations=4",
    "grpo.per_device_train_batch_size=8",
    "logging.eval_every=0",
]
GRPO_KEYS = {
    "step", "loss", "grad_norm", "learning_rate", "num_documents", "documents_seen",
    "num_tokens", "num_micro_batches", "reward", "reward_std", "frac_reward_zero_std",
    "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "entropy",
    "completions/mean_length", "sampler/logprob_mismatch",
}  # fmt: skip
CLIPS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


def _trainer(tmp_path, *overrides: str, name: str = "run") -> GRPOTrainer:
    cfg = load_run_config(CONFIG, [*TINY, f"output_dir={tmp_path / name}", *overrides])
    return GRPOTrainer(cfg)


def _steps(trainer: GRPOTrainer, n: int) -> list[dict]:
    return [trainer.step() for _ in range(n)]


def _external_rollouts(seed: int = 0):
    """8 rollouts in groups of 4 over the character vocabulary (ids 4..18; bos 2, eos 1)."""
    rng = np.random.default_rng(seed)
    prompts, completions, logps = [], [], []
    for i in range(8):
        prompt = [2, *rng.integers(4, 19, 5 + i % 2)]
        n = int(rng.integers(1, 5))
        completion = [*rng.integers(4, 19, n - 1), 1] if i % 3 else list(rng.integers(4, 19, 4))
        prompts.append(prompt)
        completions.append(completion)
        logps.append(-rng.random(len(completion)).astype(np.float32))
    rewards = [1.0, 0.0, None, 0.5, 0.0, 0.0, 1.0, 1.0]
    return prompts, completions, logps, rewards


@pytest.mark.slow
def test_on_policy_ratio_is_one_and_clip_ratios_are_zero(tmp_path):
    """μ = 1, S = g: no old log-probs, ρ ≡ 1, so every clip metric is exactly 0
    (docs/algorithms/grpo.md §9), even
    with a large learning rate. With S = 2g old log-probs are computed (equal to the sampler's
    right after generation) and the second window, one update later, clips."""
    on = _trainer(
        tmp_path, "grpo.gradient_accumulation_steps=2", "grpo.per_device_train_batch_size=4"
    )
    assert on.config.generation.steps == 2 and not on.computes_old_logprobs
    rows = _steps(on, 3)
    assert all(r.old_logp is None for r in on.rollouts.batches.values())
    for row in rows:
        assert all(row[k] == 0.0 for k in CLIPS), row
        assert row["num_documents"] == 8 and row["grad_norm"] > 0

    off = _trainer(
        tmp_path, "grpo.steps_per_generation=2", "grpo.per_device_train_batch_size=4", name="off"
    )
    assert off.computes_old_logprobs
    first = off.step()
    r = off.rollouts.current
    gaps = [np.abs(o - s).max() for o, s in zip(r.old_logp, r.sampler_logp, strict=True)]
    assert max(gaps) <= 1e-5 and len(gaps) == 8
    second = off.step()
    assert first["clip_ratio/region_mean"] < 0.05  # old log-probs of the same parameters
    assert second["clip_ratio/region_mean"] > 0.05  # one update later: off-policy, clipped


def test_fp32_sampler_and_trainer_logprobs_agree(tmp_path):
    """fp32 params and head, temperature 0.7 on both sides: the logged mismatch is ≤ 1e-5."""
    t = _trainer(tmp_path, "model.fp32_lm_head=true", "grpo.temperature=0.7")
    rows = _steps(t, 2)
    assert all(0 <= r["sampler/logprob_mismatch"] <= 1e-5 for r in rows), rows
    # the metric is mean |logp − sampler_logp| over loss tokens: shift the sampler's by 0.01
    r = t.generate()
    assert r is t.rollouts.current
    shifted = [x - 0.01 for x in r.sampler_logp]
    row = t.train_on_rollouts(r.prompt_ids, r.completion_ids, shifted, r.rewards)
    assert row["sampler/logprob_mismatch"] == pytest.approx(0.01, rel=1e-3)


@pytest.mark.slow
def test_cli_smoke_run_writes_every_metric_key_and_plot(tmp_path):
    out = tmp_path / "cli"
    args = ["train", CONFIG, "--set", f"output_dir={out}"]
    for o in (*TINY, "warm_start.steps=2", "sft.per_device_train_batch_size=32",
              "max_steps=2", "grpo.beta=0.04", "grpo.top_entropy_quantile=0.5",
              "logging.eval_every=1"):  # fmt: skip
        args += ["--set", o]
    assert main(args) == 0
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert GRPO_KEYS | {"kl", "eval/accuracy"} <= set(r), GRPO_KEYS - set(r)
        assert r["eval/accuracy"] == 0.0  # two SFT steps: the model answers nothing yet
    assert rows[0]["kl"] == 0.0 and rows[1]["kl"] > 0  # the policy is the reference at step 1
    assert (out / PLOT_NAME).stat().st_size > 1000
    assert (out / "sft" / "hf" / "config.json").is_file()  # the warm start ran first
    assert (out / "hf" / "config.json").is_file()


def _dp_trainer(tmp_path, dp: int) -> GRPOTrainer:
    return _trainer(
        tmp_path,
        f"mesh.data={dp}",
        f"grpo.per_device_train_batch_size={8 // dp}",
        f"schedule.max_tokens={64 if dp == 1 else 16}",  # a few rows vs one document per row
        # Adam turns float-noise gradients (|g| ~ eps) into ±lr steps on the first update; a
        # moderate step keeps that within the tolerance across two differently compiled meshes
        "optimizer.learning_rate=3.0e-3",
        name=f"dp{dp}",
    )


@pytest.mark.slow
def test_dp1_b8_equals_dp8_b1_through_sampler_and_external_rollouts(tmp_path):
    """Same seed, same global batch b·P = 8: generation is split over the ranks with random bits
    that do not depend on the split, so both meshes sample the same completions, and the
    engine's ratio-of-sums makes the step layout-invariant. Then the same external rollouts
    through ``train_on_rollouts`` on both meshes."""
    one, eight = _dp_trainer(tmp_path, 1), _dp_trainer(tmp_path, 8)
    pairs = [(one.step(), eight.step()) for _ in range(2)]
    ext = _external_rollouts()
    pairs.append((one.train_on_rollouts(*ext), eight.train_on_rollouts(*ext)))
    for a, b in pairs:
        assert a["num_micro_batches"] < b["num_micro_batches"]  # genuinely different layouts
        for key in ("loss", "grad_norm", "entropy", "reward", "sampler/logprob_mismatch"):
            np.testing.assert_allclose(b[key], a[key], rtol=1e-4, atol=1e-7)
        assert a["num_documents"] == b["num_documents"] == 8
        assert a["num_tokens"] == b["num_tokens"]
    a = pairs[-1][0]
    assert read_metrics(one.session.output_dir / "metrics.jsonl")[-1]["loss"] == a["loss"]
    # rewards [1,0,None,.5 | 0,0,1,1]: nanmean over the 7 scored rows; both groups have spread
    assert a["reward"] == pytest.approx(3.5 / 7) and a["frac_reward_zero_std"] == 0.0
    assert GRPO_KEYS <= set(a) and "rewards/external/mean" in a
    assert a["completions/clipped_ratio"] == pytest.approx(3 / 8)  # rows 0, 3, 6 lack eos


NEW_OPTIONS = (
    "grpo.advantage_estimator=rloo",
    "grpo.loss_type=cispo",
    "grpo.epsilon_high=1.3",
    "grpo.importance_sampling_correction=sequence_truncate",
    "grpo.importance_sampling_cap=1.2",
)


@pytest.mark.slow
def test_dp1_equals_dp8_with_rloo_cispo_and_the_sampler_correction(tmp_path):
    """The newer GRPO options together (RLOO advantages, the CISPO loss, the sampler
    correction) keep the step layout-invariant: dp=1 and dp=8 give the same loss, gradient
    norm and correction metrics; the correction reports its ratio over documents."""
    one = _trainer(tmp_path, "mesh.data=1", "schedule.max_tokens=64", *NEW_OPTIONS, name="o1")
    eight = _trainer(
        tmp_path,
        "mesh.data=8",
        "grpo.per_device_train_batch_size=1",
        "schedule.max_tokens=16",
        *NEW_OPTIONS,
        name="o8",
    )
    a, b = one.step(), eight.step()
    assert a["num_micro_batches"] < b["num_micro_batches"]
    for key in ("loss", "grad_norm", "reward", "sampler/is_ratio/mean", "sampler/is_clipped_frac"):
        np.testing.assert_allclose(b[key], a[key], rtol=1e-4, atol=1e-7)
    # fp32 sampler and trainer agree to ~1e-5 per token: ratios near 1, nothing clipped
    assert a["sampler/is_ratio/mean"] == pytest.approx(1.0, abs=1e-3)
    assert a["sampler/is_clipped_frac"] == 0.0 and a["grad_norm"] > 0


@pytest.mark.slow
def test_dp1_equals_dp8_with_reinforce_pp_and_the_kl_in_the_reward(tmp_path):
    """REINFORCE++ with β·KL in the reward: per-token advantages from old and reference
    log-probs, whitened over the batch on the host, then the same layout-invariant step; the
    loss carries no KL term of its own."""
    options = ("grpo.advantage_estimator=reinforce_pp", "grpo.kl_in_reward=true", "grpo.beta=0.5")
    one = _trainer(tmp_path, "mesh.data=1", "schedule.max_tokens=64", *options, name="k1")
    eight = _trainer(
        tmp_path,
        "mesh.data=8",
        "grpo.per_device_train_batch_size=1",
        "schedule.max_tokens=16",
        *options,
        name="k8",
    )
    assert one.computes_old_logprobs  # the KL is the generating policy's against the reference
    rows = [(one.step(), eight.step()) for _ in range(2)]
    for a, b in rows:
        assert a["num_micro_batches"] < b["num_micro_batches"]
        for key in ("loss", "grad_norm", "reward"):
            np.testing.assert_allclose(b[key], a[key], rtol=1e-4, atol=1e-7)
        assert "kl" not in a  # β·KL is in the advantages, not in the loss
    batch = one.rollouts.current
    token_adv = batch._completion_part("token_advantage")
    masks = [m[p:] for m, p in zip(batch.loss_masks, batch.prompt_lengths, strict=True)]
    flat = np.concatenate([a[m > 0] for a, m in zip(token_adv, masks, strict=True)])
    assert abs(flat.mean()) < 1e-5 and flat.std(ddof=1) == pytest.approx(1.0, abs=1e-3)
    assert rows[-1][0]["grad_norm"] > 0


def test_train_on_rollouts_moves_toward_rewarded_completions_and_masks_truncated(tmp_path):
    t = _trainer(tmp_path, name="up")
    prompts, completions, logps, _ = _external_rollouts(1)
    rewards = [1.0 if i % 4 == 0 else 0.0 for i in range(8)]
    doc = [prompts[0] + completions[0]]
    before = t.generator.scorer.token_logprobs(t.session.state.params, doc)[0]
    for _ in range(3):
        t.train_on_rollouts(prompts, completions, logps, rewards)
    after = t.generator.scorer.token_logprobs(t.session.state.params, doc)[0]
    n = len(completions[0])
    assert after[-n:].sum() > before[-n:].sum() + 0.1
    with pytest.raises(ValueError, match="not a multiple of num_generations=4"):
        t.train_on_rollouts(prompts[:6], completions[:6], logps[:6], rewards[:6])

    masked = _trainer(tmp_path, "grpo.mask_truncated_completions=true", name="masked")
    no_eos = [[*c[:-1], 5] if c[-1] == 1 else c for c in completions]
    row = masked.train_on_rollouts(prompts, no_eos, logps, rewards)  # every row truncated
    assert row["loss"] == 0.0 and row["grad_norm"] == 0.0 and row["num_documents"] == 8
    row = masked.train_on_rollouts(prompts, completions, logps, rewards)
    assert row["grad_norm"] > 0


@pytest.mark.slow
def test_docs_per_step_cuts_steps_by_document_count(tmp_path):
    t = _trainer(tmp_path, "schedule.docs_per_step=12", "schedule.max_tokens=16", "mesh.data=2")
    rows = _steps(t, 3)
    seen = 0
    for r in rows:
        assert 12 <= r["num_documents"] < 12 + 2 * 2  # overshoot < one round (2 ranks)
        seen += r["num_documents"]
        assert r["documents_seen"] == seen
    assert t.computes_old_logprobs  # leftovers wait for the next step
    b_gen = t.config.generation.size
    assert seen + len(t.rollouts) == b_gen * t.prompt_sampler.generations  # nothing dropped


class _Crash(Exception):
    pass


def straight_and_resumed(tmp_path, monkeypatch, settings: list[str], crash_at: int):
    """Metrics rows of the CLI run with ``settings`` straight through, and of the same run
    crashed when ``Session.step`` reaches ``crash_at`` and started again (it resumes from its
    newest checkpoint)."""
    monkeypatch.setenv("JAXRL_DEBUG", "1")  # the injected crash propagates out of main

    def run(name: str) -> list[dict]:
        out = tmp_path / name
        args = ["train", CONFIG, "--set", f"output_dir={out}"]
        for o in settings:
            args += ["--set", o]
        assert main(args) == 0
        return read_metrics(out / "metrics.jsonl")

    straight = run("straight")
    original = Session.run_step

    def crashing(self, *args, **kwargs):
        if self.step == crash_at:
            raise _Crash
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Session, "run_step", crashing)
    with pytest.raises(_Crash):
        run("resumed")
    monkeypatch.setattr(Session, "run_step", original)
    return straight, run("resumed")


@pytest.mark.slow
def test_interrupted_run_resumes_to_identical_metrics(tmp_path, monkeypatch):
    """Checkpoint mid-buffer (S=2, μ=2, g=1): buffer, rollouts, sampler and RNG state resume."""
    settings = [
        *TINY,
        "max_steps=5",
        "checkpoint.every=2",
        "grpo.steps_per_generation=2",
        "grpo.num_iterations=2",
        "logging.eval_every=2",
    ]
    # crash after the step-2 checkpoint, mid-buffer
    straight, resumed = straight_and_resumed(tmp_path, monkeypatch, settings, crash_at=3)
    assert [reproducible(r) for r in resumed] == [reproducible(r) for r in straight]
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5]
    assert [r["step"] for r in resumed if "eval/accuracy" in r] == [2, 4, 5]


@pytest.mark.slow
def test_host_counters_survive_resume(tmp_path, monkeypatch):
    """``zero_advantage_steps`` (and every counter of the metrics rows) counts from the run's
    start, not the process's: a constant reward makes every step's advantages 0, so the
    resumed run's step 3 reports 3, as the uninterrupted run does (it used to report 1)."""
    rewards = tmp_path / "constant_reward.py"
    rewards.write_text("def zero(completions, **kwargs):\n    return [0.0] * len(completions)\n")
    settings = [*TINY, "max_steps=4", "checkpoint.every=2", f"grpo.reward_funcs=[{rewards}:zero]"]
    straight, resumed = straight_and_resumed(tmp_path, monkeypatch, settings, crash_at=3)
    assert [r["zero_advantage_steps"] for r in straight] == [1, 2, 3, 4]
    for key in ("zero_advantage_steps", "nonfinite_steps", "empty_steps"):
        assert [r[key] for r in resumed] == [r[key] for r in straight], key
    assert [reproducible(r) for r in resumed] == [reproducible(r) for r in straight]


def _half_decided(prompts, completions, completion_ids, **kwargs):
    """Prompts with an even character sum are 'decided' (reward 1 whatever the completion: no
    signal); the others reward completions whose token sum is odd."""
    return [
        1.0 if sum(map(ord, str(p))) % 2 == 0 else float(sum(ids) % 2)
        for p, ids in zip(prompts, completion_ids, strict=True)
    ]


def _ds_trainer(tmp_path, name, *sets, reward=_half_decided):
    cfg = load_run_config(CONFIG, [*TINY, f"output_dir={tmp_path / name}", *sets])
    return GRPOTrainer(cfg, reward_funcs=[reward])


def test_dynamic_sampling_trains_only_groups_with_a_signal(tmp_path):
    """DAPO's filter: without it some groups of the batch have identical rewards; with it none
    does, the dropped groups and extra generations are reported, and the batch is still full."""
    plain = _ds_trainer(tmp_path, "plain").step()
    assert plain["frac_reward_zero_std"] > 0
    ds = _ds_trainer(tmp_path, "ds", "grpo.dynamic_sampling=true")
    rows = [ds.step() for _ in range(2)]
    for row in rows:
        assert row["frac_reward_zero_std"] == 0.0 and row["num_documents"] == 8
        assert row["dynamic_sampling/rounds"] >= 1
    assert sum(r["dynamic_sampling/dropped_groups"] for r in rows) > 0
    assert max(r["dynamic_sampling/rounds"] for r in rows) > 1


def test_dynamic_sampling_that_cannot_fill_the_batch_names_the_fix(tmp_path):
    t = _ds_trainer(
        tmp_path,
        "stuck",
        "grpo.dynamic_sampling=true",
        "grpo.max_dynamic_sampling_rounds=2",
        reward=lambda prompts, completions, **kw: [0.5] * len(completions),
    )
    with pytest.raises(ConfigError, match=r"2 generations .* found 0 of the 2 prompt groups"):
        t.step()


@pytest.mark.slow
def test_eval_rewards_reports_the_run_s_rewards_on_held_out_prompts(tmp_path):
    """``logging.eval_rewards``: a GRPO run's evaluation scores the held-out completions with
    its reward functions (exact_answer and format by default). The run's exact_answer is the
    function held-out accuracy uses, so its held-out mean is eval/accuracy, greedy and sampled;
    eval/reward is the weighted sum of both functions."""
    # one sample per prompt: the eval batch is the generation batch's shape (one program)
    t = _trainer(tmp_path, "logging.eval_rewards=true", "logging.eval_samples=1")
    m = t.evaluate()
    assert m["eval/rewards/exact_answer/mean"] == pytest.approx(m["eval/accuracy"])
    assert m["eval/rewards/exact_answer/mean_sampled"] == pytest.approx(m["eval/accuracy_sampled"])
    for mode in ("", "_sampled"):
        total = m[f"eval/rewards/exact_answer/mean{mode}"] + m[f"eval/rewards/format/mean{mode}"]
        assert m[f"eval/reward{mode}"] == pytest.approx(total)
