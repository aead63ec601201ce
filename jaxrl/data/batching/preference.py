"""Preference pairs as documents, their scheduling as whole pairs, and preference accuracy.

A pair is ``(prompt, chosen, rejected)`` (a row in TRL's preference format, read and tokenised by
``jaxrl.data.documents.dpo_documents``). Pair ``p`` becomes two documents, ids ``2p`` (chosen)
and ``2p + 1`` (rejected), each ``prompt + response`` with a token-aligned loss mask that is 1 on
the response tokens (eos included) and 0 on the prompt. Pairs are atomic
(as open-instruct PR #1447): the schedule sees a pair as one sample of ``len_c + len_r`` tokens,
and ``pair_micro_batches`` lays a scheduled pair out as its chosen then its rejected document,
adjacent in one row, so the pair occupies segments ``2q − 1`` and ``2q`` of that row.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence

import numpy as np

from jaxrl.data.batching.packing import PackingError
from jaxrl.data.batching.schedule import build_dp_schedule

# -- tokenised pairs -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PairDocuments:
    """Tokenised pairs: documents ``2p`` (chosen) and ``2p + 1`` (rejected) of pair ``p``."""

    sequences: list[np.ndarray]  # int32 token ids per document
    masks: list[np.ndarray]  # float32 token-aligned loss masks (1 on response tokens + eos)
    pair_lengths: np.ndarray  # int64 [N]: len_c + len_r, the schedule's sample length

    @property
    def num_pairs(self) -> int:
        return len(self.pair_lengths)

    def fingerprint(self) -> str:
        """SHA-256 over every document's tokens and mask (dataset + preprocessing identity)."""
        h = hashlib.sha256()
        for seq, mask in zip(self.sequences, self.masks, strict=True):
            h.update(np.int64(len(seq)).tobytes())
            h.update(np.asarray(seq, np.int32).tobytes())
            h.update(np.asarray(mask, np.float32).tobytes())
        return h.hexdigest()


# -- scheduling whole pairs -----------------------------------------------------------------


def pair_micro_batches(
    pair_ids: Sequence[int],
    pair_lengths: np.ndarray,
    *,
    dp_size: int,
    max_tokens: int,
    packing: str = "ffd",
    balance: str = "cost",
) -> list[list[list[int]]]:
    """Schedule pairs as samples of ``len_c + len_r`` tokens; return document micro-batches.

    ``out[r][m]`` lists document ids ``[2p, 2p + 1, 2q, 2q + 1, ...]`` for the pairs that
    ``build_dp_schedule`` put into rank r's m-th micro-batch, so each pair is adjacent (chosen
    then rejected) in one row and is never split. Every pair appears exactly once.
    """
    ids = [int(p) for p in pair_ids]
    if not ids:
        raise ValueError("no pairs to schedule")
    lengths = np.asarray(pair_lengths)[ids]
    if int(lengths.max()) > max_tokens:
        worst = ids[int(np.argmax(lengths))]
        raise PackingError(
            f"pair {worst} has {int(lengths.max())} tokens > schedule.max_tokens={max_tokens}: "
            "a pair's chosen and rejected share one row; raise schedule.max_tokens"
        )
    step = build_dp_schedule(
        lengths, dp_size=dp_size, max_tokens=max_tokens, packing=packing, balance=balance
    ).steps[0]
    if step.dropped_rollout_ids:
        raise RuntimeError(f"internal error: the schedule dropped pairs {step.dropped_rollout_ids}")
    return [
        [[doc for i in mb for doc in (2 * ids[i], 2 * ids[i] + 1)] for mb in rank]
        for rank in step.micro_batches
    ]


def preference_accuracy(
    policy_chosen: np.ndarray,
    policy_rejected: np.ndarray,
    ref_chosen: np.ndarray | None = None,
    ref_rejected: np.ndarray | None = None,
) -> float:
    """Fraction of pairs with margin ``z = (π_c − π_r) − (ref_c − ref_r) > 0``, strictly.

    Ties count as wrong, so a policy equal to its reference scores 0. Without references the
    margin is ``π_c − π_r`` (the policy ranks chosen above rejected; SimPO's reward margin).
    """
    margin = np.asarray(policy_chosen, np.float64) - np.asarray(policy_rejected, np.float64)
    if ref_chosen is not None and ref_rejected is not None:
        margin = margin - (np.asarray(ref_chosen, np.float64) - ref_rejected)
    return float(np.mean(margin > 0)) if margin.size else 0.0
