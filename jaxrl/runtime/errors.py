"""The error every layer raises for a bad setting."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field, the value and the fix."""
