"""Typed configs: run sections, algorithm configs, YAML loading and ``ConfigError``."""

from jaxrl.config.base import ConfigError, apply_overrides, from_dict, load_yaml, to_dict

__all__ = ["ConfigError", "apply_overrides", "from_dict", "load_yaml", "to_dict"]
