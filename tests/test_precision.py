"""Mixed precision (docs/precision.md): fp32 master weights keep every update under bf16
compute; a bf16 master is an explicit opt-in (stochastic rounding, or rounding to nearest with a
start-up warning); the no-grad scorer computes what the train step computes; steps without a
gradient are counted and warned about."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_grpo_e2e import TINY

from jaxrl.cli import main
from jaxrl.config import ConfigError, load_run_config
from jaxrl.train.precision import lost_update_fraction, stochastic_round
from jaxrl.train.run_io.metrics import read_metrics
from jaxrl.trainers.grpo import GRPOTrainer
from jaxrl.trainers.sft import SFTTrainer

SFT = "configs/sft_tiny.yaml"
GRPO = "configs/grpo_tiny.yaml"
SMALL_SFT = [
    "logging.progress=false",
    "mesh.data=2",
    "sft.per_device_train_batch_size=16",  # 32 documents a step
    "schedule.max_tokens=64",
    "logging.eval_every=0",
    "checkpoint.every=0",
]
TINY_GRPO = [*TINY, "mesh.data=2"]


def _sft_trainer(tmp_path, name: str, *sets: str) -> SFTTrainer:
    cfg = load_run_config(SFT, [*SMALL_SFT, f"output_dir={tmp_path / name}", *sets])
    return SFTTrainer(cfg)


def _host(tree):
    return [np.asarray(x, np.float32) for x in jax.tree.leaves(tree)]


def _first_moments(opt_state):
    """AdamW's ``mu`` tree (fp32, nonzero exactly where a gradient was)."""
    found = [s.mu for s in jax.tree.leaves(opt_state, is_leaf=lambda s: hasattr(s, "mu"))
             if hasattr(s, "mu")]  # fmt: skip
    assert len(found) == 1
    return found[0]


def _one_step(trainer: SFTTrainer):
    before = _host(trainer.session.state.params)
    trainer.session.resume({})
    trainer.session.train_on(trainer.next_batch())
    after = _host(trainer.session.state.params)
    mu = _host(_first_moments(trainer.session.state.opt_state))
    return before, after, mu


@pytest.mark.slow
def test_bf16_compute_with_fp32_masters_keeps_every_update_at_lr_1e6(tmp_path):
    """At lr 1e-6 an AdamW update is ~1e-6 per element, far below half a bf16 ulp of a weight
    of size 0.02 (6e-5): an fp32 master keeps it, a bf16 master rounded to nearest loses it."""
    sets = ["optimizer.learning_rate=1e-6", "optimizer.warmup_steps=0", "model.dtype=bfloat16"]
    before, after, mu = _one_step(_sft_trainer(tmp_path, "fp32", *sets))
    assert {str(x.dtype) for x in jax.tree.leaves(before)} == {"float32"}
    had_grad = np.concatenate([(m != 0).ravel() for m in mu])
    changed = np.concatenate([(a != b).ravel() for a, b in zip(after, before, strict=True)])
    assert had_grad.mean() > 0.5  # most elements get a gradient (embeddings of unused chars not)
    assert changed[had_grad].mean() >= 0.99

    bf16 = [*sets, "model.param_dtype=bfloat16", "optimizer.master_rounding=nearest"]
    before, after, mu = _one_step(_sft_trainer(tmp_path, "bf16", *bf16))
    had_grad = np.concatenate([(m != 0).ravel() for m in mu])
    changed = np.concatenate([(a != b).ravel() for a, b in zip(after, before, strict=True)])
    assert changed[had_grad].mean() < 0.05  # the bug an fp32 master fixes


@pytest.mark.slow
def test_stochastic_rounding_keeps_updates_in_expectation(tmp_path):
    """With a bf16 master and stochastic rounding, the elements that move do so in the direction
    of the fp32 update, and about as many move as the update's size over the ulp predicts."""
    sets = ["optimizer.learning_rate=1e-5", "optimizer.warmup_steps=0", "model.dtype=bfloat16"]
    ref_before, ref_after, _ = _one_step(_sft_trainer(tmp_path, "fp32", *sets))
    bf16 = [*sets, "model.param_dtype=bfloat16", "optimizer.master_rounding=stochastic"]
    before, after, _ = _one_step(_sft_trainer(tmp_path, "sr", *bf16))
    delta = np.concatenate([(a - b).ravel() for a, b in zip(after, before, strict=True)])
    ref = np.concatenate([(a - b).ravel() for a, b in zip(ref_after, ref_before, strict=True)])
    moved = delta != 0
    assert moved.mean() > 0.01  # nearest would move almost none at this size
    assert np.mean(np.sign(delta[moved]) == np.sign(ref[moved])) > 0.97
    # E[stored change] = the fp32 change: totals agree within sampling noise
    np.testing.assert_allclose(delta.sum(), ref.sum(), rtol=0.1, atol=1e-4 * np.sqrt(delta.size))


def test_stochastic_round_is_unbiased_and_picks_a_neighbour():
    x = jnp.full((100_000,), 1.0 + 2.0**-10, jnp.float32)  # 1/8 of a bf16 ulp above 1
    for sign in (1.0, -1.0):
        r = np.asarray(stochastic_round(sign * x, jax.random.key(0), jnp.bfloat16), np.float32)
        assert set(np.unique(np.abs(r)).tolist()) == {1.0, 1.0078125}
        assert abs(np.mean(np.abs(r)) - (1.0 + 2.0**-10)) < 1e-4  # 2^-10 ± 4 sigma
    exact = jnp.asarray([1.0, -2.5, 0.0, 1e-30], jnp.float32).astype(jnp.bfloat16)
    same = stochastic_round(exact.astype(jnp.float32), jax.random.key(1), jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(same), np.asarray(exact))
    inf = stochastic_round(jnp.asarray([jnp.inf, -jnp.inf]), jax.random.key(2), jnp.bfloat16)
    assert np.all(np.isinf(np.asarray(inf, np.float32)))


def test_lost_update_fraction_matches_a_float64_count():
    w = np.random.default_rng(0).normal(0, 0.02, 10_000).astype(np.float32)
    w_bf = jnp.asarray(w, jnp.bfloat16)
    a = np.abs(np.asarray(w_bf, np.float64))
    ulp = 2.0 ** (np.floor(np.log2(np.where(a > 0, a, 1.0))) - 7)  # bf16: 8 significant bits
    for lr in (1e-6, 1e-4, 1e-3):
        want = np.mean(lr < ulp / 2)
        assert abs(lost_update_fraction({"w": w_bf}, lr) - want) < 1e-3


def test_a_bf16_master_needs_an_explicit_rounding_choice():
    with pytest.raises(ConfigError, match="optimizer.master_rounding"):
        load_run_config(SFT, ["model.param_dtype=bfloat16"])
    with pytest.raises(ConfigError, match="an fp32 master keeps every update"):
        load_run_config(SFT, ["optimizer.master_rounding=stochastic"])


def test_rounding_to_nearest_warns_with_the_lost_fraction(tmp_path, capsys):
    sets = ["model.param_dtype=bfloat16", "optimizer.master_rounding=nearest"]
    _sft_trainer(tmp_path, "near", "optimizer.learning_rate=1e-6", *sets)
    err = capsys.readouterr().err
    assert "optimizer.master_rounding=nearest" in err
    lost = float(err.split("is lost, for ")[1].split("%")[0])
    assert 90 < lost <= 100  # 1e-6 is under half an ulp of nearly every weight of size ~0.02


@pytest.mark.slow
def test_bf16_compute_follows_the_fp32_loss_curve_for_20_steps(tmp_path):
    def losses(name, *sets):
        out = tmp_path / name
        args = ["train", SFT, "--set", f"output_dir={out}", "--set", "max_steps=20"]
        for s in (*SMALL_SFT, *sets):
            args += ["--set", s]
        assert main(args) == 0
        return np.asarray([r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r])

    fp32, bf16 = losses("fp32"), losses("bf16", "model.dtype=bfloat16")
    assert len(fp32) == len(bf16) == 20 and fp32[-1] < 0.9 * fp32[0]  # it learns
    np.testing.assert_allclose(bf16, fp32, rtol=0.01)


def _grpo(tmp_path, name: str, *sets: str) -> list[dict]:
    out = tmp_path / name
    args = ["train", GRPO, "--set", f"output_dir={out}"]
    for s in (*TINY_GRPO, *sets):
        args += ["--set", s]
    assert main(args) == 0
    return [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]


@pytest.mark.slow
def test_grpo_ratio_is_exactly_one_at_first_use_in_bf16(tmp_path):
    """With scored old log-probs (docs_per_step: leftover rows wait for a later step), the
    first step trains on rows generated by the current weights: the scorer computes the train
    step's forward, so log ρ is exactly 0 in bf16 compute, and nothing is clipped. The frozen
    reference (a bf16 copy of the initial masters) is the policy at step 1: KL exactly 0."""
    rows = _grpo(
        tmp_path,
        "ratio",
        "max_steps=2",
        "model.dtype=bfloat16",
        "schedule.docs_per_step=12",
        "grpo.max_completion_length=4",
        "grpo.beta=0.04",
    )
    first = rows[0]
    assert first["policy/abs_log_ratio"] == 0.0 and first["kl"] == 0.0
    assert first["clip_ratio/region_mean"] == 0.0
    assert first["num_loss_tokens"] > 0 and first["empty_steps"] == 0


@pytest.mark.slow
def test_an_all_truncated_step_is_counted_and_warned(tmp_path, capsys):
    """One-token completions of a 1-layer random model rarely end in eos: a step whose every
    completion is truncated has them all masked out and no loss token."""
    rows = _grpo(
        tmp_path,
        "trunc",
        "max_steps=3",
        "grpo.max_completion_length=1",
        "grpo.mask_truncated_completions=true",
    )
    empty = [r["completions/clipped_ratio"] == 1.0 for r in rows]
    assert empty[0]  # seed 0: step 1 is all truncated
    assert [r["num_loss_tokens"] == 0 for r in rows] == empty
    assert [r["empty_steps"] for r in rows] == np.cumsum(empty).tolist()
    assert all(r["grad_norm"] == 0 for r, e in zip(rows, empty, strict=True) if e)
    err = capsys.readouterr().err
    assert err.count("had no loss token") == 1  # warned once
    assert "grpo.max_completion_length=1" in err and "mask_truncated_completions" in err


@pytest.mark.slow
def test_zero_advantage_steps_are_counted_warned_and_end_the_run_when_asked(tmp_path, capsys):
    """A random model earns no exact-answer reward: every group's rewards are equal, so every
    advantage is 0. After grpo.zero_spread_steps such steps in a row the run warns once, and
    with grpo.stop_on_zero_spread it ends there (max_steps=4 is not reached)."""
    sets = ["grpo.max_completion_length=4", "grpo.reward_funcs=[exact_answer]"]
    sets += ["grpo.reward_weights=null", "grpo.zero_spread_steps=2"]
    rows = _grpo(tmp_path, "zero", "max_steps=4", "grpo.stop_on_zero_spread=true", *sets)
    assert all(r["frac_reward_zero_std"] == 1.0 for r in rows)
    assert [r["zero_advantage_steps"] for r in rows] == [1, 2]  # ended at step 2 of 4
    err = capsys.readouterr().err
    assert err.count("no policy gradient for 2 steps in a row") == 1
    assert err.count("stopped at step 2: 2 steps in a row without a policy gradient") == 1
    assert math.isfinite(rows[-1]["loss"])


def test_the_sampler_holds_its_weights_in_the_compute_dtype(tmp_path):
    cfg = load_run_config(GRPO, [*TINY_GRPO, f"output_dir={tmp_path}", "model.dtype=bfloat16",
                                 "grpo.beta=0.04"])  # fmt: skip
    trainer = GRPOTrainer(cfg)
    trainer.generator.sampler.load_params(trainer.session.state.params)
    dtypes = {str(x.dtype) for x in jax.tree.leaves(trainer.generator.sampler._params)}
    assert dtypes == {"bfloat16"}
    assert {str(x.dtype) for x in jax.tree.leaves(trainer.generator.ref_params)} == {"bfloat16"}
    assert {str(x.dtype) for x in jax.tree.leaves(trainer.session.state.params)} == {"float32"}


@pytest.mark.slow
def test_dpo_step_one_is_ln2_in_bf16_when_rounding_depends_on_the_layout(tmp_path):
    """bf16 compute with 16-token flash blocks: a document's log-prob depends on where its row
    puts it (block boundaries change the summation order). The training reference is scored in
    the rows of the step that trains on it, so policy = reference at step 1 to the bit."""
    out = tmp_path / "dpo"
    sets = [
        "logging.progress=false", f"output_dir={out}", "warm_start.steps=0", "max_steps=2",
        "mesh.data=2", "model.dtype=bfloat16", "model.attention_impl=flash",
        "model.attention_block_size=16", "task.train_size=48", "task.eval_size=16",
        "model.init={hidden_size: 576, num_hidden_layers: 2, num_attention_heads: 9, "
        "num_key_value_heads: 3, intermediate_size: 1536}",
        "schedule.max_tokens=512", "dpo.per_device_train_batch_size=4",
        "dpo.gradient_accumulation_steps=2", "logging.eval_every=0", "optimizer.warmup_steps=0",
    ]  # fmt: skip
    args = ["train", "configs/dpo_tiny.yaml"]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 0
    first = next(r for r in read_metrics(out / "metrics.jsonl") if "loss" in r)
    assert abs(first["loss"] - math.log(2)) < 1e-6, first["loss"]
    assert first["rewards/margin"] == 0.0
