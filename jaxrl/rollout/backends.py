"""The rollout backends a run can generate with, built by one factory from ``rollout.backend``.

``BACKENDS`` maps each ``rollout.backend`` value to its builder; :func:`build_backend` is the
one place that reads the value (the generator never compares it). Each builder takes the same
:class:`BackendSpec` (what any backend of a GRPO run is given) and returns a
:class:`jaxrl.generate.backend.RolloutBackend`. ``sync_every`` says whether
``rollout.sync_every`` applies to the kind: the engine loads every version (a synchronous
engine reads the trainer's arrays in place, which the next step donates, so it cannot keep an
older version); a vLLM server keeps the weights it was sent (docs/rollout.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from jax.sharding import Mesh

from jaxrl.config import RolloutConfig
from jaxrl.generate.backend import RolloutBackend
from jaxrl.generate.sampler import Sampler, SamplingParams
from jaxrl.models.model_config import ModelConfig
from jaxrl.rollout.weight_sync import WeightSync

__all__ = ["BACKENDS", "BackendKind", "BackendSpec", "build_backend", "weight_sync"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class BackendSpec:
    """What every backend of a run is built from."""

    config: ModelConfig  # the model it generates with (LoRA: the dense one)
    rollout: RolloutConfig  # the run's ``rollout`` section
    max_new_tokens: int  # the longest completion (grpo.max_completion_length)
    eos_id: int | Sequence[int]
    pad_id: int
    sampling: SamplingParams
    max_model_len: int  # the longest prompt + completion a request may need (a row)
    mesh: Mesh | None = None  # the engine's decode layout (None: where the parameters are)
    copy_params: bool = True  # the engine copies the weights at each sync
    log_dir: str | None = None  # where a vLLM server that jaxrl starts writes its log


def _engine(spec: BackendSpec) -> RolloutBackend:
    """jaxrl's continuous-batching engine (``jaxrl.generate.sampler``; docs/rollout.md)."""
    r = spec.rollout
    return Sampler(
        spec.config,
        max_new_tokens=spec.max_new_tokens,
        eos_id=spec.eos_id,
        pad_id=spec.pad_id,
        sampling=spec.sampling,
        mesh=spec.mesh,
        max_slots=r.max_slots,
        compact_slots=r.compact_slots,
        copy_params=spec.copy_params,
        scan_layers=r.scan_layers,
    )


def _vllm(spec: BackendSpec) -> RolloutBackend:
    """vLLM servers (``jaxrl.rollout.vllm``; docs/rollout.md, "vLLM")."""
    from jaxrl.rollout.vllm import VLLMBackend  # its HTTP and export stack only when used

    return VLLMBackend(
        spec.config,
        spec.rollout.vllm,
        max_new_tokens=spec.max_new_tokens,
        eos_id=spec.eos_id,
        pad_id=spec.pad_id,
        sampling=spec.sampling,
        max_model_len=spec.max_model_len,
        log_dir=spec.log_dir,
    )


@dataclasses.dataclass(frozen=True)
class BackendKind:
    """One ``rollout.backend`` value: its builder, and whether ``rollout.sync_every`` applies."""

    build: Callable[[BackendSpec], RolloutBackend]
    sync_every: bool


BACKENDS: dict[str, BackendKind] = {
    "engine": BackendKind(_engine, sync_every=False),
    "vllm": BackendKind(_vllm, sync_every=True),
}


def build_backend(spec: BackendSpec) -> RolloutBackend:
    """The backend ``spec.rollout.backend`` names."""
    return BACKENDS[spec.rollout.backend].build(spec)


def weight_sync(backend: RolloutBackend, rollout: RolloutConfig) -> WeightSync:
    """The trainer's sync policy for ``backend``: every ``rollout.sync_every`` versions where
    the kind keeps the weights it was sent, every version otherwise."""
    keeps = BACKENDS[rollout.backend].sync_every
    return WeightSync(backend, every=rollout.sync_every if keeps else 1)
