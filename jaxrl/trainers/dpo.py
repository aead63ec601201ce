"""DPO trainer: preference pairs → reference cache → packed pairs → exact engine → metrics.

Orchestration only: pairs and their packing live in ``jaxrl.data.batching.preference``, the
reference cache in ``jaxrl.train.ref_cache``, the no-grad forward it shares with held-out evaluation
in ``jaxrl.train.score`` (every device), the objective in ``jaxrl.train.objectives`` (the loss in
``jaxrl.losses.dpo``).
A step takes ``dpo.pairs_per_step`` pairs (b · g · P) from a seeded feed of pair ids, schedules
them as ``len_c + len_r`` samples, lays each pair out as adjacent chosen/rejected documents, and
hands the cached reference values to the loss as per-document fields.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from jaxrl.config import ConfigError, RunConfig
from jaxrl.data.batching.preference import PairDocuments, preference_accuracy
from jaxrl.data.batching.step_plan import StepBatch
from jaxrl.data.documents import dpo_documents
from jaxrl.data.feed import DocumentFeed
from jaxrl.data.tasks import TASK_SOURCE
from jaxrl.runtime import storage
from jaxrl.train.build import build_task
from jaxrl.train.objectives import NLL_WEIGHT_FIELD, REF_FIELD, dpo_objective
from jaxrl.train.ref_cache import (
    CacheIdentity,
    ReferenceCache,
    fill_pair_logps,
    load_or_build,
    pair_scores,
    tokenizer_fingerprint,
    weight_fingerprint,
)
from jaxrl.trainers.algorithm import ReferenceAlgorithm
from jaxrl.trainers.preamble import Preamble
from jaxrl.trainers.session import with_device_ranks


def orpo_nll_weight(pair_ids: Any, masks: Any) -> float:
    """ORPO's ``N_pairs / N_chosen_tokens`` of a step, from the host's data before the step:
    pair p's chosen document is 2p, and its loss tokens are its target-aligned mask
    (``masks[2p][1:] > 0``, the positions ``jaxrl.data.batching.packing`` marks), so every rank
    divides its chosen-token NLL by the same global count (docs/losses.md)."""
    ids = np.asarray(pair_ids, np.int64)
    tokens = sum(int(np.count_nonzero(np.asarray(masks[2 * p])[1:] > 0)) for p in ids)
    return float(ids.size) / max(tokens, 1)


class DPOTrainer(ReferenceAlgorithm):
    """DPO (and variants) on preference pairs; ``run()`` trains and returns a summary.

    Pairs come from ``data.train``/``data.eval`` (TRL's preference format, strings or
    conversations, with the tokenizer and chat template of ``model.path``), or default to the
    built-in arithmetic preference task (``task`` section: the same format, chosen = the
    answer, rejected = one digit changed), read and tokenised the same way.
    """

    def __init__(self, cfg: RunConfig):
        pre = Preamble(with_device_ranks(cfg))
        self.cfg, self.dpo, self.tokenizer = pre.cfg, pre.cfg.dpo, pre.tokenizer
        cfg, dpo = self.cfg, self.dpo
        if cfg.schedule.docs_per_step:
            raise ConfigError(
                f"schedule.docs_per_step={cfg.schedule.docs_per_step} is not supported for DPO: "
                "a step takes dpo.per_device_train_batch_size × gradient_accumulation_steps × "
                "mesh.data pairs; set schedule.docs_per_step=0"
            )
        if not dpo.precompute_ref_log_probs:
            raise ConfigError(
                "dpo.precompute_ref_log_probs=false (a frozen reference forward every step) is "
                "not implemented; set it to true (the reference log-prob cache)"
            )
        self.data_report = pre.data_report  # rows the length limits touched
        self._documents(pre)
        if self.dpo.pairs_per_step > self.train.num_pairs:
            raise ConfigError(
                f"dpo.per_device_train_batch_size={self.dpo.per_device_train_batch_size} is "
                f"invalid: a step takes {self.dpo.pairs_per_step} pairs (b × g × ranks) but the "
                f"training data holds {self.train.num_pairs}, so a step would hold some twice; "
                "lower the batch size or add data"
            )
        self.feed = DocumentFeed(self.train.num_pairs, seed=cfg.seed)
        cache_dir = dpo.reference_cache_dir or storage.path(cfg.output_dir) / "ref_cache"
        self.cache_dir = storage.path(cache_dir)  # a local path or a URL
        self.refs: dict[str, ReferenceCache] = {}
        self.doc_fields: dict[str, Any] = {}  # per-document fields of the training pairs
        self.initial: dict[str, Any] = {}  # the starting model's held-out numbers
        self.session = pre.session(dpo_objective(dpo, chunk_size=cfg.model.logprob_chunk))
        # reference values and held-out evaluation: the no-grad scorer on every device
        self.scorer = pre.scorer(self.session)
        self.session.programs.add("scorer", self.scorer)

    def _documents(self, pre: Preamble) -> None:
        """Pairs of the built-in task or of ``data.train`` (and ``data.eval``, with the
        tokenizer and chat template of ``model.path``); pairs over ``dpo.max_prompt_length`` /
        ``dpo.max_length`` are truncated (or dropped) and counted (docs/data.md)."""
        cfg, data, dpo = self.cfg, self.cfg.data, self.dpo
        task = build_task(cfg) if data.train is None else None
        limits = f"dpo.max_length={dpo.max_length}" + (
            f"/max_prompt_length={dpo.max_prompt_length}" if dpo.max_prompt_length else ""
        )
        self.datasets, self.held_out = {}, None
        for split, rows in pre.datasets("dpo").items():
            docs, report, _ = dpo_documents(
                rows,
                self.tokenizer,
                max_length=dpo.max_length,
                max_prompt_length=dpo.max_prompt_length,
                max_tokens=cfg.schedule.max_tokens,
            )
            if split == "train":
                self.train = docs
            else:
                self.held_out = docs
            if task is not None:  # the cache identity names the task's settings
                source = {"source": TASK_SOURCE, **dataclasses.asdict(task)}
            else:
                path = Path(rows.source)
                source = {"source": str(path.resolve()) if path.exists() else rows.source}
            self.datasets[split] = {**source, "split": rows.split, "rows": docs.num_pairs}
            pre.report(split, report, limits)

    # -- reference values -------------------------------------------------------------------
    def _identity(self, split: str, docs: PairDocuments, weights: str) -> CacheIdentity:
        cfg, tok = self.cfg, self.tokenizer
        m = cfg.model
        return CacheIdentity(
            model=m.path or f"init:{sorted(m.init.items())}",
            weights=weights,
            dataset=self.datasets[split],
            data=docs.fingerprint(),
            tokenizer=tokenizer_fingerprint(tok),
            max_length=self.dpo.max_length,
            packing={"max_tokens": cfg.schedule.max_tokens, "packing": cfg.schedule.packing},
            loss_type=self.dpo.canonical_loss_type,
            aggregation="mean" if self.dpo.uses_mean_logps else "sum",
            layout=(
                {  # the steps' layout the train split is scored in (_train_values)
                    "pairs_per_step": self.dpo.pairs_per_step,
                    "ranks": self.session.ranks,
                    "balance": cfg.schedule.balance,
                    "feed_seed": cfg.seed,
                }
                if split == "train"
                else {"rows": "pack_pairs"}
            ),
            param_dtype=m.param_dtype,
            dtype=self.session.model_config.dtype,  # model.dtype resolved (auto included)
            fp32_lm_head=m.fp32_lm_head,
            logprob_chunk=m.logprob_chunk,
        )

    def _pair_values(self, docs: PairDocuments, sink: ReferenceCache) -> None:
        """Held-out reference values, packed as ``evaluate`` packs the policy's."""
        fill_pair_logps(
            self.scorer,
            self.session.reference_params(copy=False),
            docs,
            sink,
            max_tokens=self.cfg.schedule.max_tokens,
            packing=self.cfg.schedule.packing,
            mean=self.dpo.uses_mean_logps,
        )

    def _train_values(self, sink: ReferenceCache) -> None:
        """Training reference values, each pair scored in the packed rows of the step that
        first trains on it: the steps of the first epoch are planned again from a fresh copy of
        the seeded feed. The scorer runs the train step's forward, so a pair's reference is
        computed exactly as its policy value will be (same row, offset and row length; in bf16
        the rounding depends on them), and the step-1 loss is ln 2 whatever the precision."""
        feed = DocumentFeed(self.train.num_pairs, seed=self.cfg.seed)
        left = np.ones(self.train.num_pairs, bool)
        while left.any():
            batch = self.session.plan(
                feed.take(self.dpo.pairs_per_step),
                all_ranks=True,
                pairs=True,
                lengths=self.train.pair_lengths,
                sequences=self.train.sequences,
                loss_masks=self.train.masks,
            )
            scores = self.scorer.documents(
                self.session.reference_params(copy=False),
                batch.packed,
                mean=self.dpo.uses_mean_logps,
                temperature=1.0,
            )
            new = np.asarray([p for p in batch.used if left[p]], np.int64)
            if new.size:  # the last step may reach into the next epoch: first values kept
                sink.write(new, scores.logps[2 * new], scores.logps[2 * new + 1])
                left[new] = False

    def build_references(self) -> None:
        """Load or build the train (and held-out) reference caches from the CURRENT params.

        Called before any update (and before a resume restores trained parameters), so the
        current parameters are the reference. ``simpo`` needs no reference: nothing is built.
        """
        if not self.dpo.needs_reference:
            return
        weights = weight_fingerprint(self.session.reference_params(copy=False))
        splits = {"train": self.train, "eval": self.held_out}
        for split, docs in splits.items():
            if docs is None:
                continue
            fill = self._train_values if split == "train" else partial(self._pair_values, docs)
            self.refs[split] = load_or_build(
                self.cache_dir, self._identity(split, docs, weights), docs.num_pairs, fill
            )

    # -- planning ---------------------------------------------------------------------------
    def next_batch(self) -> StepBatch:
        """The next step's ``dpo.pairs_per_step`` pairs, planned and packed (pair p → documents
        2p, 2p + 1, adjacent in one row), with their cached reference values."""
        want = self.dpo.pairs_per_step
        ids = self.feed.take_exactly(want, step=self.session.step + 1, unit="pairs")
        batch = self.session.plan(
            ids,
            pairs=True,
            lengths=self.train.pair_lengths,
            sequences=self.train.sequences,
            loss_masks=self.train.masks,
            doc_fields=self.doc_fields,
        )
        if self.dpo.loss_type == "orpo":  # the step's N_pairs / N_chosen_tokens, all ranks
            weight = orpo_nll_weight(batch.used, self.train.masks)
            shape = batch.packed.num_docs.shape
            batch.arrays[NLL_WEIGHT_FIELD] = np.full(shape, weight, np.float32)
        return batch

    # -- evaluation -------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """Held-out preference accuracy: ``eval/accuracy`` = fraction with margin z > 0 against
        the reference (0 at the start, strictly); ``eval/policy_accuracy`` = fraction with
        π_c > π_r (the policy itself prefers the chosen answer); ``eval/exact_match`` = greedy
        exact match of the chosen responses (teacher-forced argmax, as in SFT). One scoring
        pass over the held-out pairs, packed as the reference cache packs them."""
        if self.held_out is None:
            return {}
        scores = pair_scores(
            self.scorer,
            self.session.policy_params,
            self.held_out,
            max_tokens=self.cfg.schedule.max_tokens,
            packing=self.cfg.schedule.packing,
            mean=self.dpo.uses_mean_logps,
        )
        chosen, rejected = scores.logps[0::2], scores.logps[1::2]
        ref = self.refs.get("eval")
        refs = (ref.chosen, ref.rejected) if ref is not None else (None, None)
        return {
            "eval/accuracy": preference_accuracy(chosen, rejected, *refs),
            "eval/policy_accuracy": preference_accuracy(chosen, rejected),
            "eval/exact_match": scores.exact_match(np.arange(0, scores.logps.size, 2)),
        }

    # -- the contract's hooks (ReferenceAlgorithm's start, host state and summary) ---------
    description = "dpo"

    def prepare(self) -> None:
        """The reference caches, then their log-probs as per-document fields of every training
        batch."""
        self.build_references()
        self.doc_fields = {}
        if self.dpo.needs_reference:
            self.doc_fields[REF_FIELD] = self.refs["train"].document_values()

    def info(self, row: dict[str, Any]) -> str:
        return f"loss {row['loss']:.3f} acc {row['rewards/accuracy']:.2f}"

    def summary(self, summary: dict[str, Any], last: dict[str, Any]) -> dict[str, Any]:
        return {
            **super().summary(summary, last),
            "reference_cache": [str(r.path) for r in self.refs.values()],
        }
