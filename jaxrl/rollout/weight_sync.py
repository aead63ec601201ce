"""When the trainer's weights reach the rollout backend: the trainer's policy, not the backend's.

A GRPO generation tags its weights with the optimizer updates they have taken (the version).
With ``rollout.sync_every = k`` (``rollout.backend: vllm``: a sync writes and reloads a
checkpoint) a new version is sent only once the one the backend holds is k versions old; the
generations in between are made by the older weights and carry its version, so staleness,
``old_logp`` and the importance-sampling correction treat them as made by it
(docs/rollout.md). The backend itself only loads what it is told to load.

Weights loaded by someone else since the last sync (the synchronous held-out evaluator shares
the backend and loads the current parameters without a version) are not taken for a step's: the
next versioned sync sends whatever it is given.
"""

from __future__ import annotations

from typing import Any

from jaxrl.generate.backend import RolloutBackend

__all__ = ["WeightSync"]


class WeightSync:
    """Syncs of one backend, every ``every`` versions (module doc)."""

    def __init__(self, backend: RolloutBackend, every: int = 1):
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"WeightSync: every={every!r} must be an int >= 1")
        self.backend = backend
        self.every = every
        self.version: int | None = None  # the version this policy synced last (None: none yet)

    def due(self, version: int | None) -> bool:
        """Whether weights of ``version`` must be loaded now: always without a version, before
        the first sync, after another load (the backend's version is not the one synced), and
        once the synced version is ``every`` versions old."""
        if version is None or self.version is None:
            return True
        if self.backend.weight_version != self.version:
            return True
        return int(version) - self.version >= self.every

    def load(self, params: Any, version: int | None) -> None:
        """Load ``params`` into the backend as ``version`` (None: the backend's last + 1)."""
        self.backend.load_params(params, version=version)
        self.version = None if version is None else self.backend.weight_version
