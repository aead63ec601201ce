"""The shipped YAML configs, found from an installed package: ``jaxrl.configs.path("grpo_tiny")``.

Not to be confused with ``jaxrl.config``, the config *classes* (``RunConfig``, ``GRPOConfig``,
...) and their loader. The YAML files live in the repository's ``configs/`` folder; a wheel
carries a copy of them in this package (``setup.py`` copies them at build time), so a
non-editable install finds them here and a checkout (editable or on ``PYTHONPATH``) finds them
in ``configs/`` beside the package.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["directory", "names", "path"]

_HERE = Path(__file__).resolve().parent


def directory() -> Path:
    """The folder holding the shipped configs: this package's copy in an installed wheel, else
    the checkout's ``configs/``."""
    if any(_HERE.glob("*.yaml")):
        return _HERE
    checkout = _HERE.parents[1] / "configs"
    if checkout.is_dir():
        return checkout
    raise FileNotFoundError(
        f"no shipped configs in {_HERE} or {checkout}: reinstall jaxrl (pip install jaxrl)"
    )


def names() -> list[str]:
    """The shipped configs' names (``path`` takes any of them), sorted."""
    return sorted(p.stem for p in directory().glob("*.yaml"))


def path(name: str) -> Path:
    """The file of the shipped config ``name`` (``"grpo_tiny"`` or ``"grpo_tiny.yaml"``), for
    ``jaxrl.load_config`` or ``jaxrl train``. Raises ``FileNotFoundError`` naming the shipped
    configs for an unknown name."""
    stem = name.removesuffix(".yaml")
    found = directory() / f"{stem}.yaml"
    if not found.is_file():
        raise FileNotFoundError(
            f"no shipped config {name!r}: the shipped configs are {', '.join(names())}"
        )
    return found
