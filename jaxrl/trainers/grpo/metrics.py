"""The GRPO family's rows: what a step adds to the engine's metrics about the rows it trained."""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxrl.data.batching.shared_prompt import SharedPackedBatch
from jaxrl.rollout.rollout_queue import RowDocuments

__all__ = ["shared_prompt_metrics", "staleness_metrics"]


def shared_prompt_metrics(packed: Any) -> dict[str, int]:
    """``batch/trained_tokens`` and ``batch/tokens_unshared`` of a shared-prompt batch (the
    tokens the step trained and those the same documents take unshared); {} otherwise."""
    if not isinstance(packed, SharedPackedBatch):
        return {}
    return {
        "batch/trained_tokens": packed.trained_tokens,
        "batch/tokens_unshared": packed.tokens_unshared,
    }


def staleness_metrics(docs: RowDocuments, used_ids: np.ndarray, step: int) -> dict[str, Any]:
    """``rollout/staleness_mean`` / ``_max``: updates since the weights that generated each row
    trained at ``step`` (the step's number once it trained); {} for a step with no row."""
    if not used_ids.size:
        return {}
    staleness = step - 1 - docs.versions[used_ids]
    return {
        "rollout/staleness_mean": float(staleness.mean()),
        "rollout/staleness_max": int(staleness.max()),
    }
