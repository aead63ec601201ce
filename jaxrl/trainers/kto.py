"""KTO trainer: unpaired examples → reference values → the step's KL pairs and z₀ → exact engine.

Orchestration only: the examples in ``jaxrl.data.unpaired``, the loss, the KL pairs and z₀ in
``jaxrl.losses.kto``, the objective in ``jaxrl.train.objectives``. A step takes
``kto.examples_per_step`` examples (b · g · P) from a seeded feed. Before it, on the host: a
seeded derangement of the step's examples pairs every prompt with another example's completion
(over the global batch, not per device); a no-grad pre-pass scores those KL documents under the
policy and the reference (packed in rows of ``kto.max_length``, whatever the layout), and
``z₀ = max(0, Σ (π − ref) / N)`` enters the step as a constant. The examples' reference values
are scored once at the start (the reference is the starting model).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxrl.config import ConfigError, RunConfig
from jaxrl.data.batching.packing import pack_sequences
from jaxrl.data.batching.step_plan import StepBatch
from jaxrl.data.datasets import rows_dataset
from jaxrl.data.feed import DocumentFeed
from jaxrl.data.tasks import TASK_SOURCE
from jaxrl.data.unpaired import Examples, kto_examples, task_rows
from jaxrl.losses.dpo import MARGIN_TOLERANCE
from jaxrl.losses.kto import mismatched_completions, reference_point
from jaxrl.train.build import build_task
from jaxrl.train.objectives import LABEL_FIELD, REF_FIELD, Z0_FIELD, kto_objective
from jaxrl.trainers.algorithm import ReferenceAlgorithm
from jaxrl.trainers.preamble import Preamble
from jaxrl.trainers.session import with_device_ranks


class KTOTrainer(ReferenceAlgorithm):
    """KTO on ``data.train`` rows ``{prompt, completion, label}`` (TRL's unpaired format) or
    on the built-in task (pair i → its correct answer, desirable, for even i; its wrong answer,
    undesirable, for odd i); ``run()`` trains and returns a summary."""

    def __init__(self, cfg: RunConfig):
        pre = Preamble(with_device_ranks(cfg))
        self.cfg, self.kto, self.tokenizer = pre.cfg, pre.cfg.kto, pre.tokenizer
        if self.cfg.schedule.docs_per_step:
            raise ConfigError(
                f"schedule.docs_per_step={self.cfg.schedule.docs_per_step} is not supported for "
                "KTO: a step takes kto.per_device_train_batch_size × gradient_accumulation_steps "
                "× mesh.data examples; set schedule.docs_per_step=0"
            )
        self.data_report = pre.data_report
        self._examples(pre)
        want = self.kto.examples_per_step
        if not 2 <= want <= len(self.train):
            raise ConfigError(
                f"kto.per_device_train_batch_size={self.kto.per_device_train_batch_size} is "
                f"invalid: a step takes {want} examples (b × g × ranks); the KL pairs need at "
                f"least 2 and the training data holds {len(self.train)}"
            )
        self.sequences, self.masks = self.train.documents()
        self.lengths = np.asarray([len(s) for s in self.sequences], np.int64)
        self.feed = DocumentFeed(len(self.train), seed=self.cfg.seed)
        self.session = pre.session(kto_objective(self.kto, chunk_size=cfg.model.logprob_chunk))
        self.scorer = pre.scorer(self.session)
        self.session.programs.add("scorer", self.scorer)
        self.reference = self.session.reference_params()  # the starting model, kept
        self.doc_fields: dict[str, np.ndarray] = {}
        self.eval_reference: np.ndarray | None = None
        self.initial: dict[str, Any] = {}

    def _examples(self, pre: Preamble) -> None:
        cfg, kto = self.cfg, self.kto
        if cfg.data.train is None:
            task, t = build_task(cfg), cfg.task
            sizes = {"train": t.train_size, "eval": t.eval_size}
            splits = {
                s: rows_dataset(
                    task_rows(task.rows("dpo", n, split=s)), "sft", source=TASK_SOURCE, split=s
                )  # fmt: skip
                for s, n in sizes.items()
                if n
            }
        else:
            splits = pre.datasets("sft")  # prompt/completion rows; kto_examples needs label
        self.held_out = None
        limit = f"kto.max_length={kto.max_length}"
        for split, data in splits.items():
            examples, report = kto_examples(
                data, self.tokenizer, max_length=kto.max_length,
                max_prompt_length=kto.max_prompt_length,
            )  # fmt: skip
            if split == "train":
                self.train = examples
            else:
                self.held_out = examples
            pre.report(split, report, limit)

    # -- no-grad scoring -------------------------------------------------------------------
    def _score(self, params: Any, docs: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
        """Summed completion log-probs of ``docs``, packed in rows of ``kto.max_length`` (not
        the step's layout, so every layout gets the same values)."""
        packed = pack_sequences(
            [d[0] for d in docs], loss_masks=[d[1] for d in docs], row_len=self.kto.max_length
        )
        return self.scorer.documents(params, packed, mean=False).logps[: len(docs)]

    def build_references(self) -> None:
        """Reference values of every training (and held-out) example, from the starting model."""
        docs = [self.train.document(i, i) for i in range(len(self.train))]
        self.doc_fields = {
            REF_FIELD: self._score(self.reference, docs).astype(np.float32),
            LABEL_FIELD: self.train.labels.astype(np.float32),
        }
        if self.held_out is not None:
            held = [self.held_out.document(i, i) for i in range(len(self.held_out))]
            self.eval_reference = self._score(self.reference, held)

    def reference_point(self, ids: list[int]) -> float:
        """z₀ of a step: its examples' prompts with a seeded derangement of their completions,
        scored under the policy and the reference (one global Σ/Σ, docs/losses.md)."""
        rng = np.random.default_rng([self.cfg.seed, self.session.step])
        partner = mismatched_completions(len(ids), rng)
        docs = [
            self.train.document(ids[j], ids[partner[j]], self.kto.max_length)
            for j in range(len(ids))
        ]
        policy = self._score(self.session.policy_params, docs)
        return reference_point(policy, self._score(self.reference, docs))

    # -- planning ---------------------------------------------------------------------------
    def next_batch(self) -> StepBatch:
        """The next step's examples, planned and packed, with z₀ as a per-slot constant."""
        want = self.kto.examples_per_step
        ids = self.feed.take_exactly(want, step=self.session.step + 1, unit="examples")
        z0 = self.reference_point(list(ids))
        batch = self.session.plan(
            ids,
            lengths=self.lengths,
            sequences=self.sequences,
            loss_masks=self.masks,
            doc_fields=self.doc_fields,
        )
        batch.arrays[Z0_FIELD] = np.full(batch.packed.num_docs.shape, z0, np.float32)
        return batch

    # -- evaluation -------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """Held-out ``eval/accuracy``: the fraction of examples whose implicit reward has their
        label's sign (π − ref > τ for a desirable one, < −τ for an undesirable one, τ =
        ``MARGIN_TOLERANCE`` per completion token; 0 at the start, strictly), and the same
        fraction over the desirable and the undesirable examples alone
        (``eval/accuracy_desirable``, ``eval/accuracy_undesirable``). On the built-in task the
        held-out examples alternate desirable / undesirable answers."""
        if self.held_out is None or self.eval_reference is None:
            return {}
        held = self.held_out
        docs = [held.document(i, i) for i in range(len(held))]
        margin = self._score(self.session.policy_params, docs) - self.eval_reference
        tol = MARGIN_TOLERANCE * np.asarray([len(c) for c in held.completions], np.float64)
        right = np.where(held.labels, margin > tol, margin < -tol)
        out = {"eval/accuracy": float(np.mean(right))}
        for name, sel in (("desirable", held.labels), ("undesirable", ~held.labels)):
            if sel.any():  # which side the accuracy comes from
                out[f"eval/accuracy_{name}"] = float(np.mean(right[sel]))
        return out

    # -- the contract's hooks (ReferenceAlgorithm's start, host state and summary) ---------
    description = "kto"

    def info(self, row: dict[str, Any]) -> str:
        return f"loss {row['loss']:.3f} kl {row['kl']:.3f}"


__all__ = ["Examples", "KTOTrainer"]
