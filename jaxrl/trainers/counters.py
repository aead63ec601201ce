"""The host counters written to every metrics row, as one checkpointed state.

A resumed run's rows must equal an uninterrupted run's, counters included: the session saves
:class:`HostCounters` with every checkpoint (``"counters"`` in the host JSON) and restores them
on resume. Which warnings were given is not a counter: a resumed process warns once again.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

__all__ = [
    "CompileWatch",
    "HostCounters",
    "empty_cause",
    "zero_advantage_warning",
    "ZeroSpreadWatch",
]


@dataclasses.dataclass
class HostCounters:
    """Steps counted since the run began (not since this process started)."""

    nonfinite_steps: int = 0  # updates skipped for a non-finite loss or gradient
    nonfinite_in_row: int = 0  # ... in a row, up to this step (optimizer.max_nonfinite_steps)
    empty_steps: int = 0  # steps with no loss token (or a zero denominator): no gradient
    zero_advantage_steps: int = 0  # GRPO steps whose advantages were all 0: no policy gradient
    zero_advantage_in_row: int = 0  # ... in a row, up to this step (grpo.zero_spread_steps)

    def count_zero_advantages(self, advantages: np.ndarray) -> bool:
        """Count a step whose advantages are all zero (every group's rewards were equal, so
        the policy gradient is zero); whether it was one."""
        zero = bool(advantages.size > 0 and not np.any(advantages))
        self.zero_advantage_steps += zero
        self.zero_advantage_in_row = self.zero_advantage_in_row + 1 if zero else 0
        return zero

    def state_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore; a checkpoint written before the counters were saved starts them at 0."""
        for field in dataclasses.fields(self):
            setattr(self, field.name, int(state.get(field.name, 0)))


class CompileWatch:
    """The programs a run compiles (train step, scorer, sampler: each counts its traces in
    ``compiles`` and describes the shapes of the last one in ``last_compile``), summed into the
    ``compiles`` metric. A steady run compiles during its first step only; a later compile
    means a new shape bucket was reached (a longer row, a larger batch), and :meth:`news`
    names it once, so a run that keeps recompiling says why (docs/performance.md)."""

    def __init__(self) -> None:
        self._programs: dict[str, Any] = {}
        self._seen: dict[str, int] = {}

    def add(self, name: str, program: Any) -> None:
        """Watch ``program`` (a train step, a scorer or a rollout backend: each declares
        ``compiles`` and ``last_compile``), once however many names it is added under."""
        if program is not None and all(p is not program for p in self._programs.values()):
            self._programs[name] = program
            self._seen[name] = self._count(program)

    @staticmethod
    def _count(program: Any) -> int:
        return int(program.compiles)

    @property
    def total(self) -> int:
        return sum(self._count(p) for p in self._programs.values())

    def news(self, step: int) -> list[str]:
        """Lines for the programs compiled since the last call, after step 1 (compiling is what
        a first step does)."""
        lines = []
        for name, program in self._programs.items():
            count = self._count(program)
            if count > self._seen[name] and step > 1:
                shapes = program.last_compile or "a new shape"
                lines.append(
                    f"step {step}: compiled the {name} again for {shapes} (a new shape bucket; "
                    f"{count} programs so far)"
                )
            self._seen[name] = count
        return lines


def empty_cause(config: Any, truncated: np.ndarray) -> str:
    """Why a GRPO step's completions may carry no loss token (``empty_steps``), and the fix."""
    if config.mask_truncated_completions and int(truncated.sum()) == len(truncated):
        return (
            f"All {len(truncated)} completions were truncated at grpo.max_completion_length="
            f"{config.max_completion_length}, and grpo.mask_truncated_completions=true leaves "
            "truncated completions out of the loss: raise grpo.max_completion_length, or set "
            "grpo.mask_truncated_completions=false"
        )
    return "Every completion of the step is empty"


def zero_advantage_warning(step: int, config: Any, row: dict[str, Any]) -> str:
    """The warning, once a run, when ``config.zero_spread_steps`` steps in a row had every
    completion's advantage 0 (``zero_advantage_steps`` counts such steps): the run has stopped
    learning."""
    n = config.zero_spread_steps
    rewards = f" (reward {row['reward']:g})" if "reward" in row else ""
    what = "the run ends here" if config.stop_on_zero_spread else "the run goes on"
    return (
        f"warning: step {step}: no policy gradient for {n} step{'s' if n > 1 else ''} in a row: "
        f"the rewards within each group of {config.num_generations} were all equal{rewards}, "
        "so every advantage is 0 (zero_advantage_steps counts such steps). Likely causes: the "
        "completions' format collapsed (the reward functions no longer parse them: look at "
        "the logged samples and the tool-call rate), or the rewards are never (or always) "
        "earned (state the answer format in the prompt, warm-start with SFT, raise "
        "grpo.num_generations or grpo.temperature); "
        f"{what} (grpo.stop_on_zero_spread, grpo.zero_spread_steps)"
    )


class ZeroSpreadWatch:
    """``grpo.zero_spread_steps`` / ``grpo.stop_on_zero_spread``: after that many steps in a
    row without a policy gradient (``HostCounters.zero_advantage_in_row``) the run warns once,
    and ends there when asked."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.warned = False

    def reached(self, counters: HostCounters) -> bool:
        n = self.config.zero_spread_steps
        return n > 0 and counters.zero_advantage_in_row >= n

    def warnings(self, counters: HostCounters, step: int, row: dict[str, Any]) -> list[str]:
        """The warning, the first time the streak reaches the limit in this process."""
        if self.warned or not self.reached(counters):
            return []
        self.warned = True
        return [zero_advantage_warning(step, self.config, row)]

    def stops(self, counters: HostCounters) -> bool:
        return bool(self.config.stop_on_zero_spread) and self.reached(counters)

    def stop_lines(self, counters: HostCounters, step: int) -> list[str]:
        """The line a run ended by ``grpo.stop_on_zero_spread`` prints last; [] to go on."""
        if not self.stops(counters):
            return []
        return [
            f"stopped at step {step}: {self.config.zero_spread_steps} steps in a row without a "
            "policy gradient (every group's rewards were equal; grpo.stop_on_zero_spread=true). "
            "The checkpoint and metrics up to this step are kept"
        ]
