"""Config loading: YAML + overrides, errors that name the field and the fix."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import jax
import pytest
import yaml

from jaxrl.config import ConfigError, GRPOConfig, RunConfig, from_dict, load_run_config, to_dict
from jaxrl.runtime.mesh import use_devices
from jaxrl.trainers.session import with_device_ranks

ROOT = Path(__file__).resolve().parents[1]


def test_shipped_sft_config_loads_with_overrides():
    cfg = load_run_config("configs/sft_tiny.yaml", ["mesh.data=8", "schedule.max_tokens=64"])
    assert isinstance(cfg, RunConfig)
    assert cfg.mesh.data == 8 and cfg.schedule.max_tokens == 64 and cfg.algorithm == "sft"
    assert to_dict(cfg)["schedule"]["max_tokens"] == 64


@pytest.mark.parametrize(
    "override, needle",
    [
        ("schedule.docs_per_step=-1", "schedule.docs_per_step=-1"),
        ("mesh.data=0", "mesh.data=0"),
        ("schedule.max_tokens=8", "raise schedule.max_tokens"),
        ("optimizer.decay=exponential", "'cosine'"),
        ("max_steps=0", "max_steps=0"),
        ("algorithm=a2c", "'ppo'"),
        ("schedule.max_tokenz=4", "did you mean 'max_tokens'"),
        ("sft.per_device_train_batch_size=many", "expected an integer"),
        ("nonsense", "key.path=value"),
    ],
)
def test_bad_values_name_field_and_fix(override, needle):
    with pytest.raises(ConfigError) as err:
        load_run_config("configs/sft_tiny.yaml", [override])
    assert needle in str(err.value)


def test_missing_config_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_run_config("configs/nope.yaml")


# -- a config is plain data: no devices, no user code; the run fills in the world size ------


def test_building_configs_imports_neither_jax_nor_user_code(tmp_path):
    """In a fresh process: every shipped config (a -1 mesh axis included) and a config naming a
    reward file that would raise if executed build without importing jax or running the file."""
    boom = tmp_path / "boom.py"
    boom.write_text("raise SystemExit('executed')\n")
    code = (
        "import sys, glob; from jaxrl.config import load_run_config\n"
        "for path in sorted(glob.glob('configs/*.yaml')): load_run_config(path)\n"
        f"cfg = load_run_config('configs/grpo_tiny.yaml', ['grpo.reward_funcs=[{boom}:f]'])\n"
        "print(cfg.grpo.reward_funcs, 'jax' in sys.modules)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == [f"('{boom}:f',)", "False"]


def test_the_world_size_is_the_mesh_s_at_construction_or_at_run_start():
    """A fixed mesh gives the sections their world size when the config is built (so a group
    spread over ranks, b=1 × 8 ranks = G, is valid, and a batch that does not fit fails at
    once); a -1 axis leaves it to the run, which takes it from its devices."""
    group_over_ranks = ["grpo.per_device_train_batch_size=1", "grpo.num_generations=8"]
    cfg = load_run_config("configs/grpo_tiny.yaml", ["mesh.data=8", *group_over_ranks])
    assert (cfg.grpo.world_size, cfg.grpo.generation.size, cfg.sft.world_size) == (8, 8, 8)
    with pytest.raises(ConfigError, match=r"^grpo.generation_batch_size=4 is invalid: .*=8 so"):
        load_run_config("configs/grpo_tiny.yaml", ["mesh.data=4", *group_over_ranks])

    deferred = load_run_config("configs/grpo_tiny.yaml", ["mesh.data=-1", *group_over_ranks])
    assert (deferred.grpo.world_size, deferred.grpo.generation.size) == (None, None)
    assert deferred.grpo.generation.steps == 1  # S = g needs no world size
    with use_devices(jax.devices()[:8]):
        started = with_device_ranks(deferred)
    assert (started.grpo.world_size, started.grpo.generation.size) == (8, 8)
    assert started.sft.world_size == 8 and started.mesh == deferred.mesh  # the warm start's
    with use_devices(jax.devices()[:4]), pytest.raises(ConfigError, match=r"^grpo.generation_b"):
        with_device_ranks(deferred)
    assert with_device_ranks(cfg) is cfg  # a fixed mesh: nothing left to resolve


def test_dumps_read_back_and_the_world_size_is_not_a_key():
    runs = [("grpo_tiny", ["grpo.generation_batch_size=512"]), ("grpo_gsm8k_qwen", [])]
    for name, sets in [*runs, ("dpo_tiny", []), ("ppo_tiny", []), ("sft_tiny", [])]:
        cfg = load_run_config(f"configs/{name}.yaml", sets)
        dumped = to_dict(cfg)
        stage = cfg.algorithm if cfg.algorithm != "ppo" else "ppo"
        assert "world_size" not in str(dumped[stage]) and "world_size" not in str(dumped["sft"])
        assert from_dict(RunConfig, dumped).resolved() == cfg
    for config, section in [("grpo_tiny", "grpo"), ("dpo_tiny", "dpo"), ("grpo_tiny", "sft"),
                            ("ppo_tiny", "ppo.actor")]:  # fmt: skip
        with pytest.raises(ConfigError, match=rf"^{section}.world_size=2 is invalid: remove it: "
                           "the data-parallel size comes from mesh.data$"):  # fmt: skip
            load_run_config(f"configs/{config}.yaml", [f"{section}.world_size=2"])


@pytest.mark.parametrize(
    "key, fix",
    [
        ("grpo.docs_per_step=8", "set schedule.docs_per_step instead"),
        ("grpo.fp32_lm_head=true", "set model.fp32_lm_head instead"),
        ("grpo.do_eval=true", "every logging.eval_every steps; delete the key"),
        ("grpo.eval_strategy=steps", "every logging.eval_every steps; delete the key"),
        ("grpo.per_device_eval_batch_size=4", "every logging.eval_every steps; delete the key"),
        ("grpo.num_generations_eval=4", "logging.eval_samples sets the samples"),
        ("grpo.auto_find_batch_size=false", "never shrinks the batch"),
    ],
)
def test_removed_keys_are_one_line_errors_naming_what_replaces_them(key, fix):
    name, value = key.split("=")
    with pytest.raises(ConfigError) as err:
        load_run_config("configs/grpo_tiny.yaml", [key])
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{name}=")
    assert " is invalid: removed: " in message and fix in message
    field = name.removeprefix("grpo.")
    with pytest.raises(ConfigError, match=rf"^{field}=.* is invalid: removed: "):
        GRPOConfig(**{field: yaml.safe_load(value)})  # the keyword, as from Python


@pytest.mark.parametrize(
    "key, fix",
    [
        ("grpo.use_vllm=true", "set rollout.backend: vllm"),
        ("grpo.vllm_mode=server", "rollout.vllm.url"),
        ("grpo.vllm_server_base_url=http://h:8000", "rollout.vllm.url: http://host:port"),
        ("grpo.vllm_gpu_memory_utilization=0.5", "rollout.vllm.extra_args"),
        ("grpo.vllm_importance_sampling_cap=2.0", "grpo.importance_sampling_cap"),
    ],
)
def test_trl_vllm_keys_point_to_the_rollout_backend(key, fix):
    """TRL's ``use_vllm`` and ``vllm_*`` keys are not unknown keys: each names what jaxrl has
    instead (rollout.backend, rollout.vllm.*), from a config file and from Python."""
    name, value = key.split("=", 1)
    with pytest.raises(ConfigError) as err:
        load_run_config("configs/grpo_tiny.yaml", [key])
    message = str(err.value)
    assert message.startswith(f"{name}=") and "TRL's vLLM key" in message and fix in message
    assert "unknown" not in message and "\n" not in message
    with pytest.raises(ConfigError, match="TRL's vLLM key"):
        GRPOConfig(**{name.removeprefix("grpo."): yaml.safe_load(value)})


@pytest.mark.parametrize("value", ['"', "\x1b", "[1", "{a: 1"])
def test_an_override_that_is_not_yaml_is_a_one_line_config_error(value):
    """Found by tests/test_fuzz.py: ``--set key="`` raised yaml's multi-line ScannerError."""
    with pytest.raises(ConfigError) as err:
        load_run_config("configs/sft_tiny.yaml", [f"sft.max_length={value}"])
    message = str(err.value)
    assert "\n" not in message and "is not valid YAML" in message and "quote it" in message
