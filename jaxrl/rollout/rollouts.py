"""One generation batch of completions and the training documents made from its rows.

A row is one completion of one prompt. Its training document is ``prompt + completion`` (the
prompt as the sampler saw it, e.g. with BOS). Per-token fields are *token-aligned* (value i
belongs to token i of the document, 0 on the prompt), the layout ``jaxrl.data.packing`` shifts
into target alignment:

- ``loss_mask``: 1 on completion tokens, the EOS included; a completion stops at its EOS, so
  nothing after it exists. With ``mask_truncated_completions`` a completion without EOS gets 0
  everywhere (it still counts as a document);
- ``sampler_logp``: the sampler's log-prob of each completion token;
- ``old_logp`` / ``ref_logp`` (when computed): the log-prob under the parameters at generation /
  the frozen reference parameters.

Per document: ``advantage``. Everything is host numpy, JSON-serialisable for checkpoints.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["DocumentBatch", "Rollouts", "documents_of"]


@dataclasses.dataclass(frozen=True)
class DocumentBatch:
    """Training documents of some rows, ready for ``pack_micro_batches``."""

    sequences: list[np.ndarray]  # int32 prompt + completion per document
    loss_masks: list[np.ndarray]  # float32, token-aligned
    token_fields: dict[str, list[np.ndarray]]  # float32, token-aligned
    advantages: np.ndarray  # float32 [N]

    def __len__(self) -> int:
        return len(self.sequences)


@dataclasses.dataclass
class Rollouts:
    """A generation batch in global row order (B rows; rows kG … kG+G−1 share a prompt)."""

    prompt_ids: list[np.ndarray]  # int32 per row, as fed to the sampler
    completion_ids: list[np.ndarray]  # int32 per row, EOS included when the row stopped
    sampler_logp: list[np.ndarray]  # float32 per completion token
    truncated: np.ndarray  # bool [B]: no EOS within max_completion_length
    rewards: np.ndarray  # float64 [B, F]: one column per reward function, NaN = unscored
    advantages: np.ndarray  # float32 [B]
    old_logp: list[np.ndarray] | None = None  # float32 per completion token, when computed
    ref_logp: list[np.ndarray] | None = None  # float32 per completion token, when β > 0

    def __post_init__(self) -> None:
        b = len(self.prompt_ids)
        sizes = {
            "completion_ids": len(self.completion_ids),
            "sampler_logp": len(self.sampler_logp),
            "truncated": len(self.truncated),
            "rewards": len(self.rewards),
            "advantages": len(self.advantages),
        }
        bad = {k: n for k, n in sizes.items() if n != b}
        if bad:
            raise ValueError(f"rollouts with {b} prompts have {bad} rows: give one per prompt")
        for i, (c, lp) in enumerate(zip(self.completion_ids, self.sampler_logp, strict=True)):
            if len(c) != len(lp):
                raise ValueError(
                    f"row {i}: {len(c)} completion tokens but {len(lp)} sampler log-probs"
                )

    def __len__(self) -> int:
        return len(self.prompt_ids)

    @property
    def completion_lengths(self) -> np.ndarray:
        """int64 [B]: generated tokens per row (EOS included)."""
        return np.asarray([len(c) for c in self.completion_ids], np.int64)

    def documents(self, rows: Sequence[int], *, mask_truncated: bool) -> DocumentBatch:
        """The documents of ``rows`` (see the module docstring)."""
        return documents_of([(self, int(r)) for r in rows], mask_truncated=mask_truncated)

    def to_json(self) -> dict[str, Any]:
        """Plain lists (float32 values round-trip exactly through Python floats)."""

        def many(xs: list[np.ndarray] | None) -> list[list[float]] | None:
            return None if xs is None else [np.asarray(x).tolist() for x in xs]

        return {
            "prompt_ids": many(self.prompt_ids),
            "completion_ids": many(self.completion_ids),
            "sampler_logp": many(self.sampler_logp),
            "truncated": self.truncated.tolist(),
            "rewards": [[None if np.isnan(v) else v for v in row] for row in self.rewards.tolist()],
            "advantages": self.advantages.tolist(),
            "old_logp": many(self.old_logp),
            "ref_logp": many(self.ref_logp),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Rollouts:
        def many(xs: Any, dtype: Any) -> list[np.ndarray] | None:
            return None if xs is None else [np.asarray(x, dtype) for x in xs]

        rewards = np.asarray(
            [[np.nan if v is None else v for v in row] for row in data["rewards"]], np.float64
        )
        return cls(
            prompt_ids=many(data["prompt_ids"], np.int32),
            completion_ids=many(data["completion_ids"], np.int32),
            sampler_logp=many(data["sampler_logp"], np.float32),
            truncated=np.asarray(data["truncated"], bool),
            rewards=rewards.reshape(len(data["truncated"]), -1),
            advantages=np.asarray(data["advantages"], np.float32),
            old_logp=many(data["old_logp"], np.float32),
            ref_logp=many(data["ref_logp"], np.float32),
        )


def documents_of(rows: Sequence[tuple[Rollouts, int]], *, mask_truncated: bool) -> DocumentBatch:
    """Documents of ``(rollouts, row)`` pairs, possibly from several generation batches.

    A token field is present when every contributing batch has it (``old_logp``/``ref_logp``
    are computed for every batch of a run or for none).
    """
    sequences, masks, advantages = [], [], []
    fields: dict[str, list[np.ndarray]] = {"sampler_logp": []}
    optional = [
        name
        for name in ("old_logp", "ref_logp")
        if all(getattr(r, name) is not None for r, _ in rows)
    ]
    for name in optional:
        fields[name] = []
    for r, i in rows:
        prompt, completion = r.prompt_ids[i], r.completion_ids[i]
        p, n = len(prompt), len(completion)
        sequences.append(np.concatenate([prompt, completion]).astype(np.int32))
        on = 0.0 if mask_truncated and r.truncated[i] else 1.0
        masks.append(np.concatenate([np.zeros(p, np.float32), np.full(n, on, np.float32)]))
        zeros = np.zeros(p, np.float32)
        fields["sampler_logp"].append(np.concatenate([zeros, r.sampler_logp[i]]).astype(np.float32))
        for name in optional:
            values = getattr(r, name)[i]
            fields[name].append(np.concatenate([zeros, values]).astype(np.float32))
        advantages.append(r.advantages[i])
    return DocumentBatch(sequences, masks, fields, np.asarray(advantages, np.float32))
