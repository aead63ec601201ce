"""Typed configs: the run (``run``), its run-level sections (``sections``), the algorithm
sections (``sft``, ``grpo``, ``dpo``, ``kto``, ``ppo``), YAML loading and ``ConfigError``."""

from jaxrl.config.base import ConfigError, apply_overrides, from_dict, load_yaml, to_dict
from jaxrl.config.dpo import DPOConfig
from jaxrl.config.grpo import GRPOConfig
from jaxrl.config.kto import KTOConfig
from jaxrl.config.loading import anchor_reward_paths, load_run_config
from jaxrl.config.ppo import PPOConfig
from jaxrl.config.run import (
    ALGORITHMS,
    STAGE_SECTIONS,
    CheckpointConfig,
    DataConfig,
    DistributedConfig,
    ExportConfig,
    LoggingConfig,
    MeshConfig,
    ModelSection,
    OptimizerConfig,
    RolloutConfig,
    RunConfig,
    ScheduleConfig,
    TaskConfig,
    WarmStartConfig,
)
from jaxrl.config.sections.vllm import VLLMConfig
from jaxrl.config.sft import SFTConfig

__all__ = [
    "ALGORITHMS",
    "STAGE_SECTIONS",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "DistributedConfig",
    "DPOConfig",
    "GRPOConfig",
    "KTOConfig",
    "PPOConfig",
    "ExportConfig",
    "LoggingConfig",
    "RolloutConfig",
    "MeshConfig",
    "ModelSection",
    "OptimizerConfig",
    "RunConfig",
    "SFTConfig",
    "ScheduleConfig",
    "TaskConfig",
    "VLLMConfig",
    "WarmStartConfig",
    "anchor_reward_paths",
    "apply_overrides",
    "from_dict",
    "load_run_config",
    "load_yaml",
    "to_dict",
]
