"""The trainer contract: what a session loop needs of an algorithm, and the loop that drives one.

An :class:`Algorithm` is one ``algorithm:`` of a config (``jaxrl.trainers.registry`` maps each
name to its class). It owns a :class:`~jaxrl.trainers.session.Session` (mesh, model, state,
compiled step, checkpoints, metrics) and declares every member a caller uses, with a
do-nothing default where an algorithm has nothing:

- the start (:meth:`Algorithm.start`, once): :meth:`prepare` before a resume restores trained
  parameters, :meth:`load_host_state` / :meth:`restore_checkpoint` when resuming, else
  :meth:`begin` (the starting evaluation), and :meth:`precompile` in between;
- a step (:meth:`Algorithm.train_step`): :meth:`next_batch` → :meth:`train_on` →
  :meth:`after_step`'s metrics; :meth:`draw` / :meth:`hold` expose a step's sampled inputs
  (GRPO's generation) so ``jaxrl check`` replays them in another layout;
- around the steps: :meth:`evaluate`, :meth:`epoch`, :meth:`info`, :meth:`stop`, and the
  checkpoint's :meth:`host_state` (JSON) and :meth:`save_checkpoint` (device state beside it);
- the end: :meth:`summary` and :meth:`close`.

:meth:`Algorithm.run` is the one session loop every trainer runs (tunix's ``RLLearner.train``):
start, ``Session.loop`` over :meth:`train_step`, ``Session.finish``, :meth:`summary`.
:class:`ReferenceAlgorithm` is the contract's part shared by the stages that score a frozen
reference first (DPO, KTO).
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable
from typing import Any, ClassVar

from jaxrl.config import RunConfig
from jaxrl.data.batching.step_plan import StepBatch
from jaxrl.data.feed import DocumentFeed
from jaxrl.data.tokenizer import TextTokenizer
from jaxrl.trainers.session import Session, with_device_ranks

__all__ = ["Algorithm", "RLStage", "ReferenceAlgorithm", "WarmStart"]

WarmStart = Callable[[RunConfig], RunConfig]  # the SFT warm start (jaxrl.trainers.warm_start)


class Algorithm(abc.ABC):
    """One algorithm's side of a run; ``run()`` trains ``max_steps`` and returns a summary."""

    description: ClassVar[str]  # the progress bar's label
    cfg: RunConfig  # the stage's config (device ranks and stage optimizer resolved)
    session: Session
    tokenizer: TextTokenizer
    data_report: dict[str, int]  # rows the length limits touched (the first metrics row)
    started: bool = False  # start() ran

    @classmethod
    def for_run(cls, cfg: RunConfig, warm_start: WarmStart) -> Algorithm:
        """The trainer ``jaxrl train`` runs for ``cfg`` (``jaxrl.trainers.run``): by default
        ``cls(cfg)``; an RL stage checks first what the config cannot check without devices or
        user code, then runs ``warm_start`` (``RLStage``)."""
        return cls(cfg)  # type: ignore[call-arg]

    # -- the start ----------------------------------------------------------------------------
    def prepare(self) -> None:
        """What the steps need from the starting model, before a resume restores trained
        parameters (DPO, KTO: the reference values). Nothing by default."""
        return None

    def load_host_state(self, host: dict[str, Any]) -> None:
        """Resume from a checkpoint's host state (what :meth:`host_state` saved)."""
        return None

    def restore_checkpoint(self, step: int) -> None:
        """Restore the device state saved beside checkpoint ``step`` (:meth:`save_checkpoint`;
        PPO: the critic). Nothing by default."""
        return None

    def precompile(self) -> None:
        """Compile ahead what the first steps run, once the state is placed."""
        self.session.precompile_steps()

    def begin(self) -> None:
        """A fresh run's start (not a resume): e.g. the starting evaluation. Nothing by
        default."""
        return None

    def start(self, *, measure: bool = True) -> None:
        """Resume from the newest checkpoint or begin fresh; once. ``measure=False`` (``jaxrl
        check``'s single step): neither programs compiled ahead nor the starting evaluation."""
        if self.started:
            return
        self.started = True
        self.prepare()
        host = self.session.resume({})
        if host is not None:
            self.load_host_state(host)
            self.restore_checkpoint(self.session.step)
        if measure:
            self.precompile()
            if host is None:
                self.begin()

    # -- a step -------------------------------------------------------------------------------
    @abc.abstractmethod
    def next_batch(self) -> StepBatch:
        """The next step's planned and packed batch."""

    def train_on(self, batch: StepBatch) -> dict[str, Any]:
        """The optimizer step(s) on ``batch``: its metrics row."""
        return self.session.train_on(batch)

    def after_step(self, batch: StepBatch, row: dict[str, Any]) -> dict[str, Any]:
        """Metrics added to the step's row once it trained (and the bookkeeping of the data it
        used). None by default."""
        return {}

    def train_step(self) -> dict[str, Any]:
        """One optimizer step (starting first if need be): its metrics row."""
        self.start()
        batch = self.next_batch()
        row = self.train_on(batch)
        row.update(self.after_step(batch, row))
        return row

    def draw(self) -> Any:
        """Make the next step's sampled inputs now and hold them for it (GRPO: the next
        generation, loaded into the queue); returns them, or None where a step's data is read,
        not sampled (the default)."""
        return None

    def hold(self, drawn: Any) -> None:
        """Hold ``drawn`` (another run's :meth:`draw`) as the next step's sampled inputs."""
        return None

    def parameters(self) -> list[Any]:
        """Every parameter tree a step trains (the policy's; PPO: and the critic's)."""
        return [self.session.state.params]

    # -- around the steps ---------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """Held-out metrics of the current model ({} without held-out data)."""
        return {}

    def epoch(self) -> float | None:
        """Passes over the training data so far (the ``epoch`` of each row); None: not logged."""
        return None

    def info(self, row: dict[str, Any]) -> str:
        """The progress bar's text for a step's row."""
        return f"loss {row['loss']:.3f}"

    def stop(self, row: dict[str, Any]) -> bool:
        """End the run after this row (before ``max_steps``). Never by default."""
        return False

    def host_state(self) -> dict[str, Any]:
        """Everything outside the TrainState a resumed run needs, as JSON (no side effects)."""
        return {}

    def save_checkpoint(self, step: int) -> None:
        """Save device state beyond the session's TrainState beside checkpoint ``step`` (PPO:
        the critic). Nothing by default."""
        return None

    # -- the end ------------------------------------------------------------------------------
    def summary(self, summary: dict[str, Any], last: dict[str, Any]) -> dict[str, Any]:
        """The run's summary from ``Session.finish``'s and the last row."""
        return {**summary, **self.data_report}

    def close(self) -> None:
        """Release what the algorithm holds beyond the session (servers, threads)."""
        return None

    def run(self) -> dict[str, Any]:
        """Train to ``max_steps`` (resuming if a checkpoint exists); returns a summary."""
        session = self.session
        started = time.perf_counter()
        try:
            self.start()
            last = session.loop(
                self.description,
                self.train_step,
                first_row=self.data_report,
                epoch=self.epoch,
                host_state=self.host_state,
                save_state=self.save_checkpoint,
                evaluate=self.evaluate,
                info=self.info,
                stop=self.stop,
            )
            summary = session.finish(last, self.tokenizer, self.evaluate, started=started)
            return self.summary(summary, last)
        finally:
            self.close()


class RLStage(Algorithm):
    """An algorithm ``jaxrl train`` may warm-start with SFT (``sft_warmup_steps``)."""

    @classmethod
    def for_run(cls, cfg: RunConfig, warm_start: WarmStart) -> Algorithm:
        """The device ranks of a ``-1`` mesh axis resolved, the SFT warm start run, and the
        trainer built on its export."""
        return cls(warm_start(with_device_ranks(cfg)))  # type: ignore[call-arg]


class ReferenceAlgorithm(RLStage):
    """A stage that scores a frozen reference first (DPO, KTO): the reference pass before any
    resume, the start evaluation written as step 0 and kept in the host state as ``start``, a
    seeded ``feed`` of training examples."""

    feed: DocumentFeed
    initial: dict[str, Any]  # the starting model's held-out metrics

    @abc.abstractmethod
    def build_references(self) -> None:
        """The reference values of the starting model."""

    def prepare(self) -> None:
        self.build_references()

    def load_host_state(self, host: dict[str, Any]) -> None:
        self.feed.load_state_dict(host["feed"])
        self.initial = host.get("start", {})

    def begin(self) -> None:
        self.initial = self.evaluate()
        self.session.writer.write({"step": 0, **self.initial})

    def host_state(self) -> dict[str, Any]:
        return {"feed": self.feed.state_dict(), "start": self.initial}

    def epoch(self) -> float:
        return self.feed.epochs

    def summary(self, summary: dict[str, Any], last: dict[str, Any]) -> dict[str, Any]:
        return {**summary, "start": self.initial, **self.data_report}
