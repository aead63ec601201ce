"""SFT trainer: built-in task or real data (``data.train``, TRL's formats) → packed micro-batches
→ exact engine → metrics, checkpoints."""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxrl.config import ConfigError, RunConfig
from jaxrl.data.batching.packing import pack_sequences
from jaxrl.data.batching.step_plan import StepBatch
from jaxrl.data.documents import sft_documents
from jaxrl.data.feed import DocumentFeed, OutOfDataError
from jaxrl.train.objectives import sft_objective
from jaxrl.trainers.algorithm import Algorithm
from jaxrl.trainers.preamble import Preamble
from jaxrl.trainers.session import with_device_ranks


class SFTTrainer(Algorithm):
    """Supervised fine-tuning on a built-in task or on ``data.train``; ``run()`` trains and
    returns a summary.

    ``stop_at_accuracy``: end the run at the first evaluation (every ``logging.eval_every``
    steps) whose held-out exact match reaches it; ``max_steps`` is then a cap, and the learning
    rate follows the schedule of the full ``max_steps`` up to the stop.
    """

    def __init__(self, cfg: RunConfig, *, stop_at_accuracy: float | None = None):
        cfg = with_device_ranks(cfg)  # sft.world_size from the devices of a -1 mesh axis
        pre = Preamble(cfg)
        cfg = pre.cfg  # model.path local (a hub id resolved)
        self.cfg, self.tokenizer = cfg, pre.tokenizer
        self.stop_at_accuracy = stop_at_accuracy
        self.data_report = pre.data_report  # rows the length limits touched
        self._documents(pre)
        self.lengths = np.asarray([len(s) for s in self.train_seqs], np.int64)
        need = cfg.schedule.docs_per_step or cfg.sft.documents_per_step
        if need > len(self.train_seqs):
            field, value, what = "schedule.docs_per_step", cfg.schedule.docs_per_step, ""
            if not cfg.schedule.docs_per_step:
                value = cfg.sft.per_device_train_batch_size
                field, what = "sft.per_device_train_batch_size", " (b × g × ranks)"
            raise ConfigError(
                f"{field}={value} is invalid: a step takes {need} documents{what} but the "
                f"training data holds {len(self.train_seqs)} documents, so a step would hold "
                "some twice; lower it or add data (steps wrap into a new epoch only between "
                "documents, never within one step)"
            )
        self.feed = DocumentFeed(len(self.train_seqs), seed=cfg.seed)
        self.session = pre.session(sft_objective(cfg.sft, chunk_size=cfg.model.logprob_chunk))
        self.scorer = pre.scorer(self.session)
        self.session.programs.add("scorer", self.scorer)

    # -- documents --------------------------------------------------------------------------
    def _documents(self, pre: Preamble) -> None:
        """Documents of the built-in task or of ``data.train`` (and ``data.eval``); rows over
        ``sft.max_length`` are truncated and counted (docs/data.md). The built-in task's
        held-out documents train nothing: their mask selects the answers that exact match
        scores."""
        cfg = self.cfg
        builtin = cfg.data.train is None
        limit = f"sft.max_length={cfg.sft.max_length}"
        self.eval_seqs, self.eval_masks = [], []
        for split, data in pre.datasets("sft").items():
            docs = sft_documents(
                data,
                self.tokenizer,
                max_length=cfg.sft.max_length,
                completion_only_loss=cfg.sft.completion_only_loss or (builtin and split == "eval"),
            )
            if split == "train":
                self.train_seqs, self.train_masks = docs.sequences, docs.masks
            else:
                self.eval_seqs, self.eval_masks = docs.sequences, docs.masks
            pre.report(split, docs.report, limit)

    # -- planning ---------------------------------------------------------------------------
    def next_batch(self) -> StepBatch:
        """The next step's planned batch (``sft.documents_per_step`` documents, or ``docs_per_step``
        with the rest given back to the feed); nothing is ever dropped."""
        target = self.cfg.schedule.docs_per_step
        want = self.cfg.sft.documents_per_step if target == 0 else 2 * target
        ids = self.feed.take(want)
        if target and len(ids) < target or not ids:
            raise OutOfDataError(
                f"step {self.session.step + 1}: the data ran out with {len(ids)} documents "
                f"available for a step of {target or want}"
            )
        batch = self.session.plan(
            ids, lengths=self.lengths, sequences=self.train_seqs, loss_masks=self.train_masks
        )
        self.feed.give_back(batch.returned)
        return batch

    # -- evaluation -------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """Held-out ``eval/accuracy``: exact match (teacher-forced argmax over the loss-masked
        tokens, equal to greedy decoding), from the no-grad scorer on every device; with real
        data also ``eval/loss``, the token-mean cross-entropy over the same tokens. ``{}``
        when there is no held-out data."""
        if not self.eval_seqs:
            return {}
        packed = pack_sequences(
            self.eval_seqs, loss_masks=self.eval_masks, row_len=self.cfg.schedule.max_tokens
        )
        scores = self.scorer.documents(self.session.policy_params, packed)
        out = {"eval/accuracy": scores.exact_match()}
        if self.cfg.data.train is not None:
            tokens = sum(float(m[1:].sum()) for m in self.eval_masks)  # token 0 is never predicted
            out["eval/loss"] = -float(np.nansum(scores.logps)) / max(tokens, 1.0)
        return out

    def _reached(self, accuracy: float | None) -> bool:
        target = self.stop_at_accuracy
        return target is not None and accuracy is not None and accuracy >= target

    # -- the contract's hooks ------------------------------------------------------------------
    description = "sft"

    def load_host_state(self, host: dict[str, Any]) -> None:
        self.feed.load_state_dict(host["feed"])

    def host_state(self) -> dict[str, Any]:
        return {"feed": self.feed.state_dict()}

    def epoch(self) -> float:
        return self.feed.epochs

    def stop(self, row: dict[str, Any]) -> bool:
        return self._reached(row.get("eval/accuracy"))

    def summary(self, summary: dict[str, Any], last: dict[str, Any]) -> dict[str, Any]:
        return {
            **summary,
            "stopped_at_target": self._reached(last.get("eval/accuracy")),
            "eval/accuracy": summary.get("eval/accuracy"),
            **self.data_report,
        }
