"""The rollout interface: everything trainers, held-out evaluators, tool episodes, the compile
counter and ``jaxrl memory`` ask of a generator of completions, declared in one place.

:class:`jaxrl.generate.sampler.Sampler` (the continuous-batching engine) implements all of it;
``jaxrl.rollout.vllm.VLLMBackend`` (vLLM servers) implements the abstract members and keeps the
do-nothing defaults where it has nothing (no programs compiled in this process, no sessions).
Callers read only what is declared here (``tests/test_rollout_interface.py`` enumerates what they
read and checks it) and never probe a backend for optional members. Backends of a run are built
by one factory from ``rollout.backend`` (``jaxrl.rollout.backends``); when the trainer's weights
reach a backend is the trainer's policy (``jaxrl.rollout.weight_sync``), not the backend's: a
backend loads weights when told.

Memory. ``memory_bytes`` and ``weight_bytes`` count what a backend holds on *jaxrl's* devices
(the trainer process's), which is what ``jaxrl memory`` plans: the engine's KV caches and weight
copy; 0 for a backend whose caches and weights live in another process (a vLLM server: its
memory is vLLM's to reserve, ``--gpu-memory-utilization`` or ``VLLM_CPU_KVCACHE_SPACE``, even
where it shares the trainer's GPU).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jaxrl.generate.sampling import SampleResult, SamplingParams
from jaxrl.models.model_config import ModelConfig

if TYPE_CHECKING:
    from jaxrl.generate.session import EngineSession

__all__ = ["RolloutBackend"]


class RolloutBackend(abc.ABC):
    """Token-id prompts in; completions with their sampler log-probs and finish reasons out."""

    config: ModelConfig  # the model it generates with (LoRA: the dense one)
    sampling: SamplingParams  # what a call without ``sampling`` samples with
    max_new_tokens: int  # N: the longest completion a call may ask for
    weight_version: int = -1  # the version of the weights loaded last (-1: none yet)
    compiles: int = 0  # programs it compiled in this process (the run's ``compiles`` metric)
    last_compile: str = ""  # the shapes its last compile was for ("" when none)

    @abc.abstractmethod
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        key: jax.Array,
        sampling: SamplingParams | None = None,
        *,
        max_tokens: Sequence[int] | np.ndarray | None = None,
    ) -> SampleResult:
        """One completion per prompt row. Request r draws its tokens with the key
        ``fold_in(key, r)`` (``sampling.token_key``), so it does not depend on the other rows;
        ``max_tokens`` gives each request its own limit. The result holds the tokens, the
        per-token sampler log-probs, the finish reasons and the weight version used."""

    @abc.abstractmethod
    def load_params(
        self, params: Any, *, copy: bool | None = None, version: int | None = None
    ) -> None:
        """Generate with these weights from now on, as ``version`` (default: the last + 1)."""

    @abc.abstractmethod
    def memory_bytes(self, num_requests: int, num_groups: int, longest_prompt: int) -> int:
        """Bytes on jaxrl's largest device of the KV caches of a call of ``num_requests``
        requests over ``num_groups`` distinct prompts of at most ``longest_prompt`` tokens."""

    def weight_bytes(self) -> int:
        """Bytes on jaxrl's largest device of the weights it generates with (0: none there)."""
        return 0

    def precompile(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_tokens: Sequence[int] | np.ndarray | None = None,
        key: jax.Array | None = None,
    ) -> None:
        """Compile ahead what ``generate(prompts, key, max_tokens=...)`` will run (nothing for a
        backend that compiles nothing per call shape)."""
        del prompts, max_tokens, key

    def lower(self, prompts: Sequence[Sequence[int]], trainer_params: Any = None) -> dict[str, Any]:
        """The programs a generation over ``prompts`` runs on jaxrl's devices, lowered and not
        run, by name (``jaxrl memory --topology`` compiles them for the target's chips);
        ``trainer_params``: avals of the trainer's parameters, for the weight copy a sync runs.
        Empty for a backend that runs no programs on jaxrl's devices."""
        del prompts, trainer_params
        return {}

    def session(self, slots: int, max_length: int) -> EngineSession | None:
        """``slots`` slots of ``max_length`` tokens that keep conversations between calls (tool
        episodes); None: no sessions, callers re-send each conversation."""
        del slots, max_length
        return None

    def metrics(self) -> dict[str, float]:
        """Its own metrics since the last call (vLLM: sync time, requests per server)."""
        return {}

    def close(self) -> None:
        """Release what it holds outside this process (servers it started); safe to repeat."""
        return None
