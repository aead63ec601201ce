"""The host counters written to every metrics row, as one checkpointed state.

A resumed run's rows must equal an uninterrupted run's, counters included: the session saves
:class:`HostCounters` with every checkpoint (``"counters"`` in the host JSON) and restores them
on resume. Which warnings were given is not a counter: a resumed process warns once again.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["HostCounters"]


@dataclasses.dataclass
class HostCounters:
    """Steps counted since the run began (not since this process started)."""

    nonfinite_steps: int = 0  # updates skipped for a non-finite loss or gradient
    nonfinite_in_row: int = 0  # ... in a row, up to this step (optimizer.max_nonfinite_steps)
    empty_steps: int = 0  # steps with no loss token (or a zero denominator): no gradient
    zero_advantage_steps: int = 0  # GRPO steps whose advantages were all 0: no policy gradient

    def state_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore; a checkpoint written before the counters were saved starts them at 0."""
        for field in dataclasses.fields(self):
            setattr(self, field.name, int(state.get(field.name, 0)))
