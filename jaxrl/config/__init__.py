"""Typed configs: run sections, algorithm configs, YAML loading and ``ConfigError``."""

from pathlib import Path

from jaxrl.config.base import ConfigError, apply_overrides, from_dict, load_yaml, to_dict
from jaxrl.config.dpo import DPOConfig
from jaxrl.config.grpo import GRPOConfig, anchor_reward_paths
from jaxrl.config.run import (
    CheckpointConfig,
    DataConfig,
    DistributedConfig,
    ExportConfig,
    LoggingConfig,
    MeshConfig,
    ModelSection,
    OptimizerConfig,
    RunConfig,
    ScheduleConfig,
    TaskConfig,
)
from jaxrl.config.sft import SFTConfig


def load_run_config(path: str | Path | None = None, overrides=()) -> RunConfig:
    """``RunConfig`` from a YAML file (or the defaults) with ``key.path=value`` overrides;
    relative reward-function files in the YAML are relative to its directory."""
    data = anchor_reward_paths(load_yaml(path), Path(path).parent) if path is not None else {}
    return from_dict(RunConfig, apply_overrides(data, list(overrides)))


__all__ = [
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "DistributedConfig",
    "DPOConfig",
    "GRPOConfig",
    "ExportConfig",
    "LoggingConfig",
    "MeshConfig",
    "ModelSection",
    "OptimizerConfig",
    "RunConfig",
    "SFTConfig",
    "ScheduleConfig",
    "TaskConfig",
    "anchor_reward_paths",
    "apply_overrides",
    "from_dict",
    "load_run_config",
    "load_yaml",
    "to_dict",
]
