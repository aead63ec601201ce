"""GRPO's rows from generation to the optimizer step, in one container.

A row is one completion of one prompt. :class:`RolloutBatch` is one generation batch in global
row order (rows kG … kG+G−1 share a prompt) with the training document of every row, built once
when the batch is made (``jaxrl.data.documents.prompt_completion_document``): ``prompt +
completion`` ids (the prompt as the sampler saw it, e.g. with BOS) and token-aligned per-token
fields (value i belongs to token i, 0 on the prompt; ``jaxrl.data.batching.packing`` shifts them
into target alignment):

- ``loss_mask``: 1 on completion tokens, the EOS included; a completion stops at its EOS, so
  nothing after it exists. In a tool episode (``jaxrl.rollout.episodes``) the completion holds
  several turns and the environment's tokens between them, which get 0. With
  ``mask_truncated_completions`` a completion without EOS gets 0 everywhere (it still counts as a
  document);
- ``sampler_logp``: the sampler's log-prob of each completion token;
- ``old_logp`` / ``ref_logp`` (when computed): the log-prob under the parameters at generation /
  the frozen reference parameters;
- ``token_advantage`` (REINFORCE++ with the KL in the reward, ``grpo.kl_in_reward``): each
  completion token's own advantage, used instead of the row's (PPO: the whitened GAE advantage);
- ``value_old`` / ``returns`` (PPO, ``jaxrl.trainers.ppo``): the critic's values at generation
  and the GAE returns R = A + V_old, the critic's targets.

Per row: ``truncated``, its rewards (one column per reward function) and its ``advantage``.

:class:`RolloutQueue` holds every row from generation to the update: the batches that rows still
refer to, TRL's generation buffer (``jaxrl.rollout.buffer.GenerationBuffer``: which rows
micro-step k serves, μ passes over the current batch), and the rows served but not yet trained
on. A step takes the documents of the pending rows (:meth:`RolloutQueue.window`), trains on some
of them (a ``docs_per_step`` cut leaves the rest for the next step) and reports which it left
(:meth:`RolloutQueue.done`); batches no row refers to any more are released. Everything is host
numpy; :meth:`RolloutQueue.state_dict` is JSON and goes into every checkpoint, so a resumed run
trains on exactly the rows an uninterrupted one would.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxrl.config.grpo import GRPOConfig
from jaxrl.data.documents import completion_field, prompt_completion_document
from jaxrl.rollout.buffer import GenerationBuffer

__all__ = ["RolloutBatch", "RolloutQueue", "RowDocuments"]

# token fields computed for every batch of a run or for none
OPTIONAL_FIELDS = ("old_logp", "ref_logp", "token_advantage", "value_old", "returns")
MOE_FIELD_PREFIX = "moe_"  # a MoE sampler's recorded routes and the replay flag (docs/moe.md)


@dataclasses.dataclass(eq=False)
class RolloutBatch:
    """A generation batch in global row order and the document of every row (module docstring).

    Make one with :meth:`build`; ``prompt_ids``, ``completion_ids`` and the completion parts of
    the log-prob fields are views into the documents.
    """

    sequences: list[np.ndarray]  # int32 prompt + completion per row
    prompt_lengths: np.ndarray  # int64 [B]
    loss_masks: list[np.ndarray]  # float32 per row, token-aligned
    token_fields: dict[str, list[np.ndarray]]  # float32 per row, token-aligned
    truncated: np.ndarray  # bool [B]: no EOS within max_completion_length
    rewards: np.ndarray  # float64 [B, W]: one column per reward function, NaN = unscored
    advantages: np.ndarray  # float32 [B]
    mask_truncated: bool  # truncated rows carry no loss (mask_truncated_completions)
    policy_version: int = 0  # optimizer updates the generating weights had taken
    completion_masks: list[np.ndarray] | None = None  # tool episodes: 0 on environment tokens
    episode_stats: dict[str, np.ndarray] | None = None  # tool episodes: per-row statistics

    @classmethod
    def build(
        cls,
        prompt_ids: Sequence[np.ndarray],
        completion_ids: Sequence[np.ndarray],
        sampler_logp: Sequence[np.ndarray],
        truncated: np.ndarray,
        rewards: np.ndarray,
        advantages: np.ndarray,
        *,
        mask_truncated: bool,
        old_logp: Sequence[np.ndarray] | None = None,
        ref_logp: Sequence[np.ndarray] | None = None,
        token_advantage: Sequence[np.ndarray] | None = None,
        value_old: Sequence[np.ndarray] | None = None,
        returns: Sequence[np.ndarray] | None = None,
        completion_masks: Sequence[np.ndarray] | None = None,
        episode_stats: Mapping[str, np.ndarray] | None = None,
    ) -> RolloutBatch:
        """The batch of B rows (``completion_ids`` with EOS included when the row stopped;
        ``sampler_logp`` one per completion token) and its documents. ``completion_masks``
        (tool episodes, ``jaxrl.rollout.episodes``): per completion token, 1 for the model's
        tokens and 0 for the environment's, which then carry no loss; ``episode_stats``: the
        episodes' per-row statistics (``turns``, ``tool_calls``, ``tool_failures``)."""
        b = len(prompt_ids)
        sizes = {
            "completion_ids": len(completion_ids),
            "sampler_logp": len(sampler_logp),
            "truncated": len(truncated),
            "rewards": len(rewards),
            "advantages": len(advantages),
        }
        bad = {k: n for k, n in sizes.items() if n != b}
        if bad:
            raise ValueError(f"rollouts with {b} prompts have {bad} rows: give one per prompt")
        truncated = np.asarray(truncated, bool)
        sequences, masks, logps = [], [], []
        for i, (prompt, completion, lp) in enumerate(
            zip(prompt_ids, completion_ids, sampler_logp, strict=True)
        ):
            if len(completion) != len(lp):
                raise ValueError(
                    f"row {i}: {len(completion)} completion tokens but {len(lp)} sampler log-probs"
                )
            on = 0.0 if mask_truncated and truncated[i] else 1.0
            ids, mask = prompt_completion_document(prompt, completion, completion_loss=on)
            if completion_masks is not None:  # environment tokens: no loss
                if len(completion_masks[i]) != len(completion):
                    raise ValueError(
                        f"row {i}: {len(completion)} completion tokens but "
                        f"{len(completion_masks[i])} completion mask values"
                    )
                mask[len(prompt) :] *= np.asarray(completion_masks[i], np.float32)
            sequences.append(ids)
            masks.append(mask)
            logps.append(completion_field(len(prompt), lp))
        batch = cls(
            sequences=sequences,
            prompt_lengths=np.asarray([len(p) for p in prompt_ids], np.int64),
            loss_masks=masks,
            token_fields={"sampler_logp": logps},
            truncated=truncated,
            rewards=np.asarray(rewards, np.float64),
            advantages=np.asarray(advantages, np.float32),
            mask_truncated=mask_truncated,
            completion_masks=(
                None
                if completion_masks is None
                else [np.asarray(m, np.float32) for m in completion_masks]
            ),
            episode_stats=(
                None
                if episode_stats is None
                else {k: np.asarray(v, np.int64) for k, v in episode_stats.items()}
            ),
        )
        optional = (old_logp, ref_logp, token_advantage, value_old, returns)
        for name, values in zip(OPTIONAL_FIELDS, optional, strict=True):
            if values is not None:
                batch.set_completion_field(name, values)
        return batch

    def __len__(self) -> int:
        return len(self.sequences)

    def set_completion_field(self, name: str, values: Sequence[np.ndarray]) -> None:
        """Per-completion-token ``values`` of every row (e.g. old log-probs), stored as the
        token-aligned field ``name`` of the documents."""
        if len(values) != len(self):
            raise ValueError(f"{name}: {len(values)} rows for a batch of {len(self)}")
        self.token_fields[name] = [
            completion_field(int(p), v) for p, v in zip(self.prompt_lengths, values, strict=True)
        ]

    def _completion_part(self, name: str) -> list[np.ndarray] | None:
        values = self.token_fields.get(name)
        if values is None:
            return None
        return [v[p:] for v, p in zip(values, self.prompt_lengths, strict=True)]

    @property
    def prompt_ids(self) -> list[np.ndarray]:
        """int32 per row, as fed to the sampler."""
        return [s[:p] for s, p in zip(self.sequences, self.prompt_lengths, strict=True)]

    @property
    def completion_ids(self) -> list[np.ndarray]:
        """int32 per row, EOS included when the row stopped."""
        return [s[p:] for s, p in zip(self.sequences, self.prompt_lengths, strict=True)]

    @property
    def sampler_logp(self) -> list[np.ndarray]:
        """float32 per completion token."""
        return self._completion_part("sampler_logp")  # type: ignore[return-value]

    @property
    def old_logp(self) -> list[np.ndarray] | None:
        """float32 per completion token, when computed."""
        return self._completion_part("old_logp")

    @property
    def ref_logp(self) -> list[np.ndarray] | None:
        """float32 per completion token, when β > 0."""
        return self._completion_part("ref_logp")

    @property
    def completion_lengths(self) -> np.ndarray:
        """int64 [B]: generated tokens per row (EOS included)."""
        lengths = [len(s) - p for s, p in zip(self.sequences, self.prompt_lengths, strict=True)]
        return np.asarray(lengths, np.int64)

    def to_json(self) -> dict[str, Any]:
        """Plain lists of the rows (float32 values round-trip exactly through Python floats);
        :meth:`from_json` builds the documents again."""

        def many(xs: list[np.ndarray] | None) -> list[list[float]] | None:
            return None if xs is None else [np.asarray(x).tolist() for x in xs]

        return {
            "prompt_ids": many(self.prompt_ids),
            "completion_ids": many(self.completion_ids),
            "sampler_logp": many(self.sampler_logp),
            "truncated": self.truncated.tolist(),
            "rewards": [[None if np.isnan(v) else v for v in row] for row in self.rewards.tolist()],
            "advantages": self.advantages.tolist(),
            **{name: many(self._completion_part(name)) for name in OPTIONAL_FIELDS},
            "mask_truncated": self.mask_truncated,
            "policy_version": self.policy_version,
            "completion_masks": many(self.completion_masks),
            "episode_stats": (
                None
                if self.episode_stats is None
                else {k: v.tolist() for k, v in self.episode_stats.items()}
            ),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RolloutBatch:
        def many(xs: Any, dtype: Any) -> list[np.ndarray] | None:
            return None if xs is None else [np.asarray(x, dtype) for x in xs]

        rewards = np.asarray(
            [[np.nan if v is None else v for v in row] for row in data["rewards"]], np.float64
        )
        batch = cls.build(
            many(data["prompt_ids"], np.int32),  # type: ignore[arg-type]
            many(data["completion_ids"], np.int32),  # type: ignore[arg-type]
            many(data["sampler_logp"], np.float32),  # type: ignore[arg-type]
            np.asarray(data["truncated"], bool),
            rewards.reshape(len(data["truncated"]), -1),
            np.asarray(data["advantages"], np.float32),
            mask_truncated=bool(data["mask_truncated"]),
            **{name: many(data.get(name), np.float32) for name in OPTIONAL_FIELDS},
            completion_masks=many(data.get("completion_masks"), np.float32),
            episode_stats=data.get("episode_stats"),
        )
        batch.policy_version = int(data.get("policy_version", 0))
        return batch


@dataclasses.dataclass(frozen=True)
class RowDocuments:
    """The documents of some rows, possibly from several batches, ready for the step planner.

    A token field is present when every contributing batch has it (``old_logp``/``ref_logp``
    are computed for every batch of a run or for none).
    """

    rows: list[tuple[int, int]]  # (generation, row) of every document
    sequences: list[np.ndarray]  # int32 prompt + completion
    loss_masks: list[np.ndarray]  # float32, token-aligned
    token_fields: dict[str, list[np.ndarray]]  # float32, token-aligned
    advantages: np.ndarray  # float32, one per document
    truncated: np.ndarray  # bool, one per document
    versions: np.ndarray  # int64, one per document: its batch's policy_version

    def __len__(self) -> int:
        return len(self.rows)


class RolloutQueue:
    """Every GRPO row from generation to the optimizer step (module docstring).

    Typical use, one optimizer step::

        for _ in range(g):                       # or until docs_per_step rows are pending
            if queue.needs_generation:
                queue.load(generate())           # a RolloutBatch of B_gen rows
            queue.serve()                        # micro-step k: every rank's chunk k % S
        window = queue.window()                  # the pending rows' documents
        ...                                      # plan, train on some of them
        queue.done(window, returned)             # positions in the window left for later
    """

    def __init__(self, config: GRPOConfig, *, seed: int = 0):
        self.buffer = GenerationBuffer(config, seed=seed)
        self.batches: dict[int, RolloutBatch] = {}  # generation id → batch, while referred to
        self.pending: deque[tuple[int, int]] = deque()  # (generation, row) not yet trained on
        self.next_id = 0  # generation ids (internal and external batches)
        self.current_id: int | None = None  # the generation in the buffer

    def __len__(self) -> int:
        """Rows served and not yet trained on."""
        return len(self.pending)

    @property
    def needs_generation(self) -> bool:
        """The buffer is due a new generation batch (TRL's ``k % (S·μ) == 0``, or empty)."""
        return self.buffer.needs_generation

    @property
    def current(self) -> RolloutBatch | None:
        """The generation batch in the buffer."""
        return None if self.current_id is None else self.batches[self.current_id]

    def _keep(self, batch: RolloutBatch) -> int:
        gen, self.next_id = self.next_id, self.next_id + 1
        self.batches[gen] = batch
        return gen

    def load(self, batch: RolloutBatch) -> None:
        """A new generation batch (``B_gen`` rows, global order) into the buffer."""
        gen = self._keep(batch)
        self.buffer.load({"row": np.arange(len(batch)), "generation": np.asarray(gen)})
        self.current_id = gen

    def serve(self) -> None:
        """One micro-step: every rank's buffered chunk joins the pending rows."""
        for chunk in self.buffer.serve():
            gen = int(chunk["generation"])
            self.pending.extend((gen, int(r)) for r in chunk["row"])

    def submit(self, batch: RolloutBatch) -> None:
        """Rows generated elsewhere (``train_on_rollouts``): all pending, outside the buffer."""
        gen = self._keep(batch)
        self.pending.extend((gen, i) for i in range(len(batch)))

    def window(self) -> RowDocuments:
        """The documents of the pending rows, in order (nothing is built: each row's document
        was built with its batch)."""
        rows = list(self.pending)
        batches = [self.batches[g] for g in sorted({g for g, _ in rows})]
        names = ["sampler_logp"] + [
            n for n in OPTIONAL_FIELDS if all(n in b.token_fields for b in batches)
        ]
        moe = sorted(n for n in batches[0].token_fields if n.startswith(MOE_FIELD_PREFIX))
        names += [n for n in moe if all(n in b.token_fields for b in batches)]
        fields: dict[str, list[np.ndarray]] = {n: [] for n in names}
        sequences, masks, advantages, truncated = [], [], [], []
        for g, i in rows:
            b = self.batches[g]
            sequences.append(b.sequences[i])
            masks.append(b.loss_masks[i])
            for n in names:
                fields[n].append(b.token_fields[n][i])
            advantages.append(b.advantages[i])
            truncated.append(b.truncated[i])
        return RowDocuments(
            rows=rows,
            sequences=sequences,
            loss_masks=masks,
            token_fields=fields,
            advantages=np.asarray(advantages, np.float32),
            truncated=np.asarray(truncated, bool),
            versions=np.asarray([self.batches[g].policy_version for g, _ in rows], np.int64),
        )

    def batches_of(self, window: RowDocuments, positions: Sequence[int]) -> list[RolloutBatch]:
        """The batches the documents at ``positions`` of a window came from, by generation."""
        return [self.batches[g] for g in sorted({window.rows[i][0] for i in positions})]

    def done(self, window: RowDocuments, returned: Sequence[int]) -> None:
        """A step trained on its window but the documents at ``returned``, which stay pending
        in order; batches neither a pending row nor the buffer refers to are released."""
        self.pending = deque(window.rows[i] for i in returned)
        keep = {g for g, _ in self.pending} | {self.current_id}
        self.batches = {g: b for g, b in self.batches.items() if g in keep}

    def state_dict(self) -> dict[str, Any]:
        """JSON: the buffer (counter, permutation generator, chunks), the batches still
        referred to, the pending rows and the generation ids."""
        return {
            "buffer": self.buffer.state_dict(),
            "batches": {str(g): b.to_json() for g, b in self.batches.items()},
            "pending": [list(x) for x in self.pending],
            "next_id": self.next_id,
            "current_id": self.current_id,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.buffer.load_state_dict(state["buffer"])
        self.batches = {int(g): RolloutBatch.from_json(b) for g, b in state["batches"].items()}
        self.pending = deque((int(g), int(r)) for g, r in state["pending"])
        self.next_id, self.current_id = int(state["next_id"]), state["current_id"]
