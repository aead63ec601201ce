"""The rollout interface: what trainers, held-out evaluators, episodes and ``jaxrl memory`` ask
of a generator. :class:`jaxrl.generate.sampler.Sampler` (the continuous-batching engine)
implements it; another backend (a remote server, a static-batch sampler) plugs in by providing
the same four members. A backend that compiles per call shape may add ``precompile(prompts,
*, max_tokens=None, key=None)`` (the engine's: the program a later ``generate`` of these
prompts runs, compiled ahead on a background thread); :func:`precompile` calls it where it
exists.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import jax
import numpy as np

from jaxrl.generate.sampling import SampleResult, SamplingParams

__all__ = ["RolloutBackend", "precompile"]


@runtime_checkable
class RolloutBackend(Protocol):
    """Token-id prompts in; completions with their sampler log-probs and finish reasons out."""

    max_new_tokens: int  # N: the longest completion a call may ask for
    weight_version: int  # the version of the weights loaded last (-1: none yet)

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
        ...

    def load_params(self, params: Any, *, copy: bool | None = None, version: int | None = None):
        """Generate with these weights from now on, as ``version`` (default: the last + 1)."""
        ...

    def memory_bytes(self, num_requests: int, num_groups: int, longest_prompt: int) -> int:
        """Bytes on the largest device of the KV caches of a call of ``num_requests`` requests
        over ``num_groups`` distinct prompts of at most ``longest_prompt`` tokens."""
        ...


def precompile(
    backend: RolloutBackend,
    prompts: Sequence[Sequence[int]],
    *,
    max_tokens: Sequence[int] | np.ndarray | None = None,
    key: jax.Array | None = None,
) -> None:
    """Have ``backend`` compile ahead what ``generate(prompts, key, max_tokens=...)`` will run,
    when it compiles per call shape (the engine); nothing for one that does not (a server)."""
    ahead = getattr(backend, "precompile", None)
    if ahead is not None:
        ahead(prompts, max_tokens=max_tokens, key=key)
