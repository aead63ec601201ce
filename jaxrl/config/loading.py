"""A run's config from its YAML file and ``key.path=value`` overrides: the one loader the command
line, ``jaxrl memory``, tests and notebooks use."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from jaxrl.config.base import apply_overrides, from_dict, load_yaml
from jaxrl.config.reward_entries import reward_file_spec
from jaxrl.config.run import RunConfig
from jaxrl.config.sections.mesh import DistributedConfig, MeshConfig

__all__ = ["anchor_reward_paths", "load_run_config"]


def load_run_config(
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    *,
    before_build: Callable[[MeshConfig, DistributedConfig], None] | None = None,
) -> RunConfig:
    """``RunConfig`` from a YAML file (or the defaults) with ``key.path=value`` overrides;
    relative reward-function files in the YAML are relative to its directory. Raises
    ``ConfigError``; touches no device and runs no user code.

    ``before_build(mesh, distributed)`` is called with those two sections, checked, before the
    rest of the config is built: the command line asks XLA for the CPU host devices the mesh
    needs and starts the multi-process job there, before anything may import jax.
    """
    data = anchor_reward_paths(load_yaml(path), Path(path).parent) if path is not None else {}
    data = apply_overrides(data, list(overrides))
    if before_build is not None:
        mesh = _section(MeshConfig, data, "mesh")
        before_build(mesh, _section(DistributedConfig, data, "distributed"))
    return from_dict(RunConfig, data).resolved()


def _section(cls: type, data: dict[str, Any], key: str) -> Any:
    """Section ``key`` of a config dict (its defaults when absent or not a mapping: building the
    whole config then says what is wrong with it)."""
    value = data.get(key)
    return from_dict(cls, value, where=key) if isinstance(value, Mapping) else cls()


def anchor_reward_paths(data: dict[str, Any], base_dir: str | Path) -> dict[str, Any]:
    """Make the relative ``file.py:function`` entries of a YAML dict's ``grpo.reward_funcs``
    (and ``grpo.tools``, ``grpo.environment``, ``grpo.tool_parser``; the same keys of PPO's
    ``ppo.actor``) relative to ``base_dir`` (the YAML file's directory), in place; returns
    ``data``. Entries given later (``--set``) stay relative to the current directory."""
    ppo = data.get("ppo")
    for section in (data.get("grpo"), ppo.get("actor") if isinstance(ppo, dict) else None):
        if isinstance(section, dict):
            _anchor_section(section, base_dir)
    return data


def _anchor_section(section: dict[str, Any], base_dir: str | Path) -> None:
    """``anchor_reward_paths`` of one GRPO section, in place."""

    def anchored(spec: Any) -> Any:
        parts = reward_file_spec(spec) if isinstance(spec, str) else None
        if parts and not Path(parts[0]).is_absolute():
            return f"{Path(base_dir) / parts[0]}:{parts[1]}"
        return spec

    for key in ("reward_funcs", "tools"):  # and the tool functions (docs/tools.md)
        if isinstance(section.get(key), list):
            section[key] = [anchored(spec) for spec in section[key]]
    for key in ("environment", "tool_parser"):
        if key in section:
            section[key] = anchored(section[key])
