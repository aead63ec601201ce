"""Config loading: YAML + overrides, errors that name the field and the fix."""

from __future__ import annotations

import pytest

from jaxrl.config import ConfigError, RunConfig, load_run_config, to_dict


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
        ("algorithm=ppo", "'grpo'"),
        ("schedule.max_tokenz=4", "did you mean 'max_tokens'"),
        ("sft.batch_size=many", "expected an integer"),
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
