"""The one map from a config's ``algorithm:`` to its trainer class (``jaxrl.config.ALGORITHMS``
lists the names, ``tests/test_algorithm.py`` keeps the two in step). The classes are imported
when asked for, so ``import jaxrl.trainers`` stays light."""

from __future__ import annotations

from collections.abc import Callable

from jaxrl.config import ConfigError, RunConfig
from jaxrl.trainers.algorithm import Algorithm

__all__ = ["TRAINERS", "algorithm_class", "build"]


def _sft() -> type[Algorithm]:
    from jaxrl.trainers.sft import SFTTrainer

    return SFTTrainer


def _grpo() -> type[Algorithm]:
    from jaxrl.trainers.grpo import GRPOTrainer

    return GRPOTrainer


def _dpo() -> type[Algorithm]:
    from jaxrl.trainers.dpo import DPOTrainer

    return DPOTrainer


def _kto() -> type[Algorithm]:
    from jaxrl.trainers.kto import KTOTrainer

    return KTOTrainer


def _ppo() -> type[Algorithm]:
    from jaxrl.trainers.ppo import PPOTrainer

    return PPOTrainer


TRAINERS: dict[str, Callable[[], type[Algorithm]]] = {
    "sft": _sft,
    "grpo": _grpo,
    "dpo": _dpo,
    "kto": _kto,
    "ppo": _ppo,
}


def algorithm_class(name: str) -> type[Algorithm]:
    """The trainer class of ``algorithm: name``."""
    if name not in TRAINERS:
        raise ConfigError(f"algorithm={name!r} has no trainer: use one of {', '.join(TRAINERS)}")
    return TRAINERS[name]()


def build(cfg: RunConfig) -> Algorithm:
    """The trainer of ``cfg`` on the config as it is (no warm start: ``jaxrl check``, tests)."""
    return algorithm_class(cfg.algorithm)(cfg)  # type: ignore[call-arg]
