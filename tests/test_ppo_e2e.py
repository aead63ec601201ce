"""PPO end to end (algorithm: ppo): config errors, the actor's and the critic's step the same on
every layout, resume with the critic, and the CLI (docs/algorithms/ppo.md)."""

from __future__ import annotations

import copy
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.config import ConfigError, load_run_config
from jaxrl.runtime.mesh import use_devices
from jaxrl.trainers.check import compare, outcome
from jaxrl.trainers.ppo import PPOTrainer

SMALL = [
    "warm_start.steps=0",
    "optimizer.learning_rate=1e-3",
    "optimizer.warmup_steps=0",
    "optimizer.eps=1e-3",  # Adam's ε: see tests/test_orpo.py
    "ppo.actor.num_generations=4",
    "ppo.actor.beta=0.05",  # the KL in the reward (k1), against a reference ≠ the policy (below)
    "ppo.critic_learning_rate=1e-3",
    "task.train_size=64",
    "task.eval_size=8",
    "model.init={hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 4, "
    "num_key_value_heads: 2, intermediate_size: 64}",
]
LAYOUTS = {  # 16 completions per step in every layout
    "dp1_1mb": (["mesh.data=1", "ppo.actor.per_device_train_batch_size=16",
                 "schedule.max_tokens=512"], 1),
    "dp1_4mb": (["mesh.data=1", "ppo.actor.per_device_train_batch_size=16",
                 "schedule.max_tokens=40"], 1),
    "dp8": (["mesh.data=8", "ppo.actor.per_device_train_batch_size=2",
             "schedule.max_tokens=32"], 8),
    "d2f2t2": (["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2",
                "ppo.actor.per_device_train_batch_size=4", "schedule.max_tokens=48"], 8),
}  # fmt: skip


def test_ppo_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="ppo.gae_lambda"):
        load_run_config("configs/ppo_tiny.yaml", ["ppo.gae_lambda=1.5"])
    with pytest.raises(ConfigError, match="ppo.kl_estimator"):
        load_run_config("configs/ppo_tiny.yaml", ["ppo.kl_estimator=k2"])
    with pytest.raises(ConfigError, match="ppo.clip_range_value"):
        load_run_config("configs/ppo_tiny.yaml", ["ppo.clip_range_value=0"])
    cfg = load_run_config("configs/ppo_tiny.yaml", ["rollout.max_staleness=1"])
    with pytest.raises(ConfigError, match="rollout.max_staleness"):
        PPOTrainer(cfg)


def _with_value_head(trainer):
    """A nonzero value head (the same in every layout), so V_old ≠ 0 and the backbone gets a
    gradient at step 1 (the head starts at 0)."""
    critic = trainer.critic
    d = trainer.session.model_config.hidden_size
    head = np.random.default_rng(0).normal(scale=0.5, size=(d, 1)).astype(np.float32)

    def put(path, x):
        return jnp.asarray(head) if "value_kernel" in jax.tree_util.keystr(path) else x

    params = jax.tree_util.tree_map_with_path(put, critic.state.params)
    critic.state = critic.step_fn.place(critic.state.replace(params=params))


def _layout_step(name, tmp_path, generation=None):
    """One PPO step of LAYOUTS[name] on ``generation`` (None: this layout generates it, against
    a reference of the starting weights × 1.5 so that the KL in the reward is not 0)."""
    sets, devices = LAYOUTS[name]
    cfg = load_run_config("configs/ppo_tiny.yaml", [*SMALL, *sets, f"output_dir={tmp_path / name}"])
    with use_devices(jax.devices()[:devices]):
        trainer = PPOTrainer(cfg)
        trainer.start(measure=False)  # as jaxrl check: no start evaluation
        _with_value_head(trainer)
        if generation is None:
            ref = trainer.generator.ref_params
            trainer.generator.ref_params = jax.tree.map(lambda x: x * 1.5, ref)
            generation = copy.deepcopy(trainer.draw())
        else:
            trainer.hold(copy.deepcopy(generation))  # values: this layout's critic
        result = outcome(trainer, trainer.train_step())
        trainer.close()
    return result, generation


@pytest.mark.slow
def test_ppo_actor_and_critic_steps_are_the_same_in_every_layout(tmp_path):
    ref, generation = _layout_step("dp1_1mb", tmp_path)
    row = ref.row
    assert row["num_micro_batches"] == 1 and row["kl_in_reward"] != 0
    assert row["value_loss"] > 0 and row["critic/grad_norm"] > 0 and row["grad_norm"] > 0
    for name in ("dp1_4mb", "dp8", "d2f2t2"):
        outcome, _ = _layout_step(name, tmp_path, generation)
        if name == "dp1_4mb":
            assert outcome.row["num_micro_batches"] >= 4
        diffs = compare(outcome, ref)
        assert set(diffs) >= {"loss", "grad_norm", "params", "value_loss", "critic/grad_norm"}
        # the actor's loss is a mean of O(1) terms (whitened advantages: unit variance) that
        # cancel to ~1e-8, so another summation order moves it by fp32 rounding of O(1) terms:
        # tensor parallelism (its split sums, and V_old) by 1.7e-8 absolute, dp=8's psum by
        # 1.3e-8 on an AMD EPYC: compared relative to 1, not to 1e-2 (grad norm and parameters
        # keep their relative 1e-6)
        diffs["loss"] = abs(outcome.loss - ref.loss) / max(abs(ref.loss), 1.0)
        assert max(diffs.values()) <= 1e-6, (name, diffs)


class _Crash(Exception):
    pass


def _run(tmp_path, name):
    from jaxrl.trainers import run

    sets = [*SMALL, *LAYOUTS["dp1_1mb"][0], f"output_dir={tmp_path / name}", "max_steps=3",
            "ppo.actor.num_iterations=2",  # μ = 2: step 2 trains on step 1's generation
            "checkpoint.every=1", "logging.eval_every=0", "logging.progress=false"]  # fmt: skip
    with use_devices(jax.devices()[:1]):
        return run(load_run_config("configs/ppo_tiny.yaml", sets))


def _rows(path):
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_ppo_resume_gives_the_uninterrupted_next_step_critic_included(tmp_path, monkeypatch):
    """A run stopped after step 1, mid-generation (μ = 2: its rows, with their V_old and
    returns, wait in the checkpointed queue; the critic is checkpointed beside the policy), and
    started again gives the uninterrupted run's steps 2 and 3, the actor's and the critic's
    numbers; the exported critic reads back through ppo.critic_path."""
    from jaxrl.trainers.session import Session

    straight = _run(tmp_path, "straight")
    original = Session.run_step

    def crashing(self, *args, **kwargs):
        if self.step == 1:
            raise _Crash
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Session, "run_step", crashing)
    with pytest.raises(_Crash):
        _run(tmp_path, "resumed")
    monkeypatch.setattr(Session, "run_step", original)
    _run(tmp_path, "resumed")
    straight_rows, resumed_rows = _rows(tmp_path / "straight"), _rows(tmp_path / "resumed")
    assert [r["step"] for r in straight_rows] == [r["step"] for r in resumed_rows] == [1, 2, 3]
    assert straight_rows[1]["policy/abs_log_ratio"] > 0  # step 2 is off-policy: the same rows
    for a, b in zip(straight_rows[1:], resumed_rows[1:], strict=True):
        for key in ("loss", "grad_norm", "value_loss", "critic/grad_norm", "value/mean", "reward"):
            assert a[key] == b[key], (a["step"], key)
    critic = tmp_path / "straight" / "critic" / "hf"
    assert straight["critic_export"] == str(critic) and (critic / "value_head.npz").is_file()
    cfg = load_run_config(
        "configs/ppo_tiny.yaml",
        [*SMALL, *LAYOUTS["dp1_1mb"][0], f"output_dir={tmp_path / 'from_export'}",
         f"ppo.critic_path={critic}"],
    )  # fmt: skip
    with use_devices(jax.devices()[:1]):
        trainer = PPOTrainer(cfg)
        exported = np.load(critic / "value_head.npz")["kernel"]
        kernel = [
            x for p, x in jax.tree_util.tree_leaves_with_path(trainer.critic.state.params)
            if "value_kernel" in jax.tree_util.keystr(p)
        ]  # fmt: skip
        np.testing.assert_array_equal(np.asarray(kernel[0]), exported)
        assert np.any(exported != 0)
        trainer.critic.close()
