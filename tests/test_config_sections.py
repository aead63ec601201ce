"""A run composed of the sections it uses, one home per concept (docs/config_reference.md): the
warm_start section, the learning rate in ``optimizer``, per-rank batches in every section, PPO's
actor under ``ppo.actor``, and the moved keys refused with a pointer to their new home. Config
parsing only: nothing here trains."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from jaxrl.config import (
    ALGORITHMS,
    ConfigError,
    GRPOConfig,
    PPOConfig,
    RunConfig,
    SFTConfig,
    WarmStartConfig,
    from_dict,
    load_run_config,
    to_dict,
)
from jaxrl.config.reference import render
from jaxrl.config.run import STAGE_SECTIONS
from jaxrl.trainers.warm_start import warm_start_config

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = (ROOT / "docs" / "config_reference.md").read_text()

MOVED = [  # (config, --set, the start of the fix the error gives)
    ("grpo_tiny", "sft_warmup_steps=5", "moved: set warm_start.steps"),
    ("grpo_tiny", "sft_warmup_target=0.5", "moved: set warm_start.target"),
    ("grpo_tiny", "sft_warmup_eval_every=3", "moved: set warm_start.eval_every"),
    ("grpo_tiny", "grpo.learning_rate=1e-4", "set optimizer.learning_rate"),
    ("grpo_tiny", "grpo.warmup_steps=3", "set optimizer.warmup_steps"),
    ("grpo_tiny", "grpo.lr_scheduler_type=linear", "set optimizer.decay"),
    ("dpo_tiny", "dpo.learning_rate=1e-4", "set optimizer.learning_rate"),
    ("kto_tiny", "kto.learning_rate=1e-4", "set optimizer.learning_rate"),
    ("sft_tiny", "sft.learning_rate=1e-4", "set optimizer.learning_rate"),
    ("sft_tiny", "sft.batch_size=64", "sft.per_device_train_batch_size to batch_size / "),
    ("ppo_tiny", "ppo.actor.learning_rate=1e-4", "set optimizer.learning_rate"),
]


@pytest.mark.parametrize(("config", "item", "fix"), MOVED, ids=[m[1] for m in MOVED])
def test_moved_keys_are_one_line_errors_naming_their_new_home(config, item, fix):
    """From the command line and from a YAML file alike; the reference page lists each."""
    key, value = item.split("=")
    with pytest.raises(ConfigError) as err:
        load_run_config(f"configs/{config}.yaml", [item])
    message = str(err.value)
    assert message.startswith(f"{key}=") and fix in message and "\n" not in message
    assert "unknown config key" not in message
    name = key.rsplit(".", 1)[-1]
    assert re.search(rf"`[a-z_.]*{re.escape(name)}`: .*{re.escape(fix[:20])}", REFERENCE), key


def test_moved_keys_are_refused_from_python_too():
    with pytest.raises(ConfigError, match=r"^sft_warmup_steps=3 is invalid: moved: set warm_st"):
        RunConfig(algorithm="grpo", sft_warmup_steps=3)
    with pytest.raises(ConfigError, match=r"^batch_size=8 is invalid: removed: it was global"):
        SFTConfig(batch_size=8)


def test_the_warm_start_section_replaces_the_three_top_level_keys():
    cfg = load_run_config("configs/grpo_tiny.yaml", ["warm_start.eval_every=4"])
    ws = cfg.warm_start
    assert (ws.steps, ws.target, ws.eval_every, ws.learning_rate) == (500, 0.5, 4, 1.5e-3)
    assert (
        cfg.warm_starts
        and not load_run_config("configs/grpo_tiny.yaml", ["warm_start.steps=0"]).warm_starts
    )
    for item, field in [
        ("warm_start.steps=-1", "warm_start.steps=-1"),
        ("warm_start.target=1.5", "warm_start.target=1.5"),
        ("warm_start.eval_every=0", "warm_start.eval_every=0"),
        ("warm_start.learning_rate=0", "warm_start.learning_rate=0.0"),
        ("warm_start.decay=step", "warm_start.decay='step'"),
        ("warm_start.stepz=3", "did you mean 'steps'"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(field)):
            load_run_config("configs/grpo_tiny.yaml", [item])


def test_the_warm_start_has_its_own_schedule_and_the_stage_the_optimizer_s():
    """The SFT run a warm start makes: the warm start's peak / warmup / decay over optimizer's
    (AdamW's other settings shared), its steps as the SFT run's length, the target's eval
    cadence, the SFT section alone; the RL stage trains with ``optimizer`` as given."""
    cfg = load_run_config("configs/grpo_tiny.yaml", ["warm_start.decay=linear"])
    sft = warm_start_config(cfg)
    assert (sft.algorithm, sft.max_steps, sft.logging.eval_every) == ("sft", 500, 10)
    opt, stage = sft.optimizer, cfg.optimizer
    assert (opt.learning_rate, opt.warmup_steps, opt.decay) == (1.5e-3, 50, "linear")
    assert (stage.learning_rate, stage.warmup_steps, stage.decay) == (3e-4, 10, "cosine")
    assert (opt.weight_decay, opt.b2, opt.max_grad_norm) == (0.01, 0.95, 1.0)
    assert sft.grpo is None and sft.warm_start is None and sft.sft == cfg.sft
    assert sft.output_dir.endswith("/sft")
    unset = warm_start_config(load_run_config("configs/dpo_tiny.yaml"))
    assert (unset.optimizer.learning_rate, unset.optimizer.warmup_steps) == (1.5e-3, 50)
    dpo = load_run_config("configs/dpo_tiny.yaml").optimizer
    assert (dpo.learning_rate, dpo.warmup_steps) == (1e-4, 50)  # unset: optimizer's


@pytest.mark.parametrize(
    ("config", "item", "message"),
    [
        ("grpo_tiny", "dpo.beta=0.2", "dpo is invalid with algorithm: grpo: it is the section of "
         "algorithm: dpo; remove it (--set dpo=null) or set algorithm: dpo"),
        ("dpo_tiny", "kto.beta=0.2", "kto is invalid with algorithm: dpo"),
        ("ppo_tiny", "grpo.beta=0.1", "grpo is invalid with algorithm: ppo: PPO's rollouts and "
         "actor are the ppo.actor section: move the grpo keys there"),
        ("grpo_tiny", "ppo.gamma=0.9", "ppo is invalid with algorithm: grpo"),
        ("grpo_gsm8k_qwen", "sft.max_length=64", "sft is invalid with algorithm: grpo: the sft "
         "section is algorithm: sft's, or a warm start's"),
        ("sft_tiny", "warm_start.steps=5", "warm_start is invalid with algorithm: sft"),
        ("sft_tiny", "grpo.beta=0.1", "grpo is invalid with algorithm: sft"),
    ],
)  # fmt: skip
def test_a_section_of_another_algorithm_is_refused(config, item, message):
    with pytest.raises(ConfigError) as err:
        load_run_config(f"configs/{config}.yaml", [item])
    assert str(err.value).startswith(message), str(err.value)


def test_a_run_carries_only_the_sections_it_uses():
    """Each algorithm gets its own section (defaults when not given) and no other; the sft
    section comes with a warm start; dumps hold nothing else and read back."""
    for name in ALGORITHMS:
        cfg = RunConfig(algorithm=name)
        present = {s for s in ("sft", "grpo", "dpo", "kto", "ppo") if getattr(cfg, s) is not None}
        assert present == {name}, name
        assert cfg.stage is (cfg.ppo.actor if name == "ppo" else getattr(cfg, name))
        assert STAGE_SECTIONS[name] == ("ppo.actor" if name == "ppo" else name)
    warm = RunConfig(algorithm="dpo", warm_start=WarmStartConfig(steps=3))
    assert warm.sft is not None and warm.warm_starts
    dumped = to_dict(load_run_config("configs/dpo_tiny.yaml"))
    assert dumped["grpo"] is None and dumped["ppo"] is None and dumped["sft"] is not None
    assert from_dict(RunConfig, dumped).resolved() == load_run_config("configs/dpo_tiny.yaml")


def test_ppo_s_actor_is_ppo_actor_and_the_stage_properties_follow():
    cfg = load_run_config("configs/ppo_tiny.yaml", ["mesh.data=8", "ppo.actor.temperature=0.7"])
    actor = cfg.ppo.actor
    assert isinstance(cfg.ppo, PPOConfig) and isinstance(actor, GRPOConfig)
    assert cfg.stage is actor and cfg.grpo is None
    assert (actor.temperature, actor.world_size, actor.generation.size) == (0.7, 8, 2048)
    assert cfg.samples_rollouts and cfg.trains_critic
    grpo = load_run_config("configs/grpo_tiny.yaml")
    assert grpo.samples_rollouts and not grpo.trains_critic
    dpo = load_run_config("configs/dpo_tiny.yaml")
    assert not dpo.samples_rollouts and not dpo.trains_critic
    for item, field in [
        ("ppo.actor.shared_prompt_packing=true", "ppo.actor.shared_prompt_packing=True"),
        ("ppo.actor.advantage_estimator=rloo", "ppo.actor.advantage_estimator='rloo'"),
        ("ppo.actor.world_size=2", "ppo.actor.world_size=2"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(field)):
            load_run_config("configs/ppo_tiny.yaml", [item])


def test_ppo_actor_reward_files_are_relative_to_the_yaml(tmp_path):
    data = yaml.safe_load((ROOT / "configs/ppo_tiny.yaml").read_text())
    data["ppo"]["actor"]["reward_funcs"] = ["my_rewards.py:score"]
    (tmp_path / "ppo.yaml").write_text(yaml.safe_dump(data))
    cfg = load_run_config(tmp_path / "ppo.yaml")
    assert cfg.ppo.actor.reward_funcs == (f"{tmp_path}/my_rewards.py:score",)


def test_every_section_s_batch_is_per_rank():
    """b × g × ranks examples per step, SFT included (TRL's per_device_train_batch_size)."""
    sets = ["mesh.data=2", "mesh.fsdp=4", "sft.per_device_train_batch_size=3",
            "sft.gradient_accumulation_steps=2"]  # fmt: skip
    sft = load_run_config("configs/sft_tiny.yaml", sets).sft
    assert (sft.world_size, sft.documents_per_step) == (8, 3 * 2 * 8)
    dpo = load_run_config("configs/dpo_tiny.yaml", ["mesh.data=8"]).dpo
    assert dpo.pairs_per_step == 32 * 8
    deferred = load_run_config("configs/sft_tiny.yaml", ["mesh.data=-1"])
    assert deferred.sft.world_size is None and not deferred.batch_ranks_known
    assert deferred.with_batch_ranks(4).sft.documents_per_step == 128 * 4
    with pytest.raises(ConfigError, match=r"^sft.gradient_accumulation_steps=0 is invalid"):
        load_run_config("configs/sft_tiny.yaml", ["sft.gradient_accumulation_steps=0"])


def test_the_reference_page_explains_the_composition_and_is_current():
    assert render() == REFERENCE
    texts = ["## `warm_start`", "## `ppo.actor`", "| ranks (P) | `mesh.data × mesh.fsdp`"]
    texts.append("per_device_train_batch_size × gradient_accumulation_steps × ranks")
    for text in texts:
        assert text in " ".join(REFERENCE.split()), text
    assert "## `sft`" in REFERENCE and "`sft.batch_size`: it was global" in REFERENCE


def test_grpo_config_fields_are_plain():
    """No descriptor and no int subclass: the dataclass fields hold ints."""
    c = GRPOConfig(per_device_train_batch_size=4, num_generations=4, world_size=2)
    fields = {f.name: f for f in dataclasses.fields(GRPOConfig)}
    assert fields["generation_batch_size"].default is None
    assert type(c.generation_batch_size) is int and c.generation_batch_size == 8
