"""Preference pairs: a built-in arithmetic task, a JSONL loader, tokenisation and pair packing.

A pair is ``(prompt, chosen, rejected)``. Pair ``p`` becomes two documents, ids ``2p`` (chosen)
and ``2p + 1`` (rejected), each ``[bos] prompt response [eos]`` with a token-aligned loss mask
that is 1 on the response tokens (eos included) and 0 on bos and the prompt. Pairs are atomic
(as open-instruct PR #1447): the schedule sees a pair as one sample of ``len_c + len_r`` tokens,
and ``pair_micro_batches`` lays a scheduled pair out as its chosen then its rejected document,
adjacent in one row, so the pair occupies segments ``2q − 1`` and ``2q`` of that row.
"""

from __future__ import annotations

import dataclasses
import hashlib
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from jaxrl.data.datasets import DataError, read_jsonl
from jaxrl.data.packing import PackingError
from jaxrl.data.schedule import build_dp_schedule
from jaxrl.data.tasks import ArithmeticTask
from jaxrl.data.tokenizer import TextTokenizer

KEYS = ("prompt", "chosen", "rejected")


class PreferenceDataError(DataError):
    """A preference data file or pair is malformed; the message names the line or row."""


@dataclasses.dataclass(frozen=True)
class PreferencePair:
    """One comparison: the prompt, the preferred response and the dispreferred one."""

    prompt: str
    chosen: str
    rejected: str


# -- the built-in task ----------------------------------------------------------------------


def _corrupt_one_digit(answer: str, key: str, seed: int, msd_last: bool) -> str:
    """``answer`` with one digit replaced by a different digit, chosen from a hash of ``key``.

    The most significant digit of a multi-digit answer never becomes 0 (the wrong answer keeps
    the shape of a number); ``msd_last`` says it is the last character (reversed answers).
    """
    rng = np.random.default_rng([seed, zlib.crc32(key.encode())])
    digits = [i for i, ch in enumerate(answer) if ch.isdigit()]
    pos = digits[int(rng.integers(len(digits)))]
    msd = digits[-1] if msd_last else digits[0]
    lowest = 1 if (pos == msd and len(digits) > 1) else 0
    choices = [d for d in range(lowest, 10) if str(d) != answer[pos]]
    new = str(choices[int(rng.integers(len(choices)))])
    return answer[:pos] + new + answer[pos + 1 :]


def arithmetic_pairs(task: ArithmeticTask, n: int, *, split: str = "train") -> list[PreferencePair]:
    """``n`` pairs of a split: chosen = the exact answer, rejected = one digit changed.

    Problems are ``task.examples(n, split=split)``, so train and held-out pairs never share a
    prompt. The changed digit is a deterministic function of ``task.seed`` and the prompt.
    """
    return [
        PreferencePair(
            ex.prompt,
            ex.answer,
            _corrupt_one_digit(ex.answer, ex.prompt, task.seed, task.reverse_answer),
        )
        for ex in task.examples(n, split=split)
    ]


# -- users' data ----------------------------------------------------------------------------


def load_jsonl_pairs(path: str | Path) -> list[PreferencePair]:
    """Pairs from a JSONL file, one ``{"prompt", "chosen", "rejected"}`` object per line.

    Blank lines are skipped; extra keys are ignored. The file is read as ``jaxrl train`` reads
    data (``jaxrl.data.datasets.read_jsonl``): any problem raises ``PreferenceDataError`` naming
    the file, the 1-based line number and the key.
    """
    path = Path(path)
    try:
        rows, where = read_jsonl(path)
    except DataError as e:
        raise PreferenceDataError(str(e)) from None
    pairs: list[PreferencePair] = []
    for obj, at in zip(rows, where, strict=True):
        if not isinstance(obj, dict):
            raise PreferenceDataError(
                f"{at}: expected an object with keys {list(KEYS)}, got {type(obj).__name__}"
            )
        for key in KEYS:
            if key not in obj:
                raise PreferenceDataError(
                    f"{at}: missing key {key!r} (every line needs {list(KEYS)})"
                )
            value = obj[key]
            if not isinstance(value, str):
                raise PreferenceDataError(
                    f"{at}: {key!r} must be a string, got {type(value).__name__}"
                )
            if not value:
                raise PreferenceDataError(f"{at}: {key!r} is an empty string")
        pairs.append(PreferencePair(obj["prompt"], obj["chosen"], obj["rejected"]))
    if not pairs:
        raise PreferenceDataError(f"{path}: no preference pairs (the file has no data lines)")
    return pairs


# -- tokenisation ---------------------------------------------------------------------------


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


def encode_pairs(
    pairs: Sequence[PreferencePair],
    tok: TextTokenizer,
    *,
    max_length: int,
    max_tokens: int | None = None,
) -> PairDocuments:
    """Tokenise pairs as ``[bos] prompt response [eos]`` documents with response masks.

    Raises ``PreferenceDataError`` naming the row when a document exceeds ``max_length``
    tokens, when a response encodes to no tokens, or when ``len_c + len_r > max_tokens`` (a
    pair must fit one micro-batch row; it is never split or silently dropped).
    """
    sequences: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    lengths = np.zeros(len(pairs), np.int64)
    for row, pair in enumerate(pairs):
        prompt = tok.encode(pair.prompt, add_bos=True)
        for name in ("chosen", "rejected"):
            response = tok.encode(getattr(pair, name))
            if not response:
                raise PreferenceDataError(f"row {row}: {name} encodes to no tokens")
            ids = prompt + response + [tok.eos_id]
            if len(ids) > max_length:
                raise PreferenceDataError(
                    f"row {row}: the {name} document has {len(ids)} tokens > dpo.max_length="
                    f"{max_length}; raise dpo.max_length or shorten the row"
                )
            mask = np.zeros(len(ids), np.float32)
            mask[len(prompt) :] = 1.0
            sequences.append(np.asarray(ids, np.int32))
            masks.append(mask)
            lengths[row] += len(ids)
        if max_tokens is not None and lengths[row] > max_tokens:
            len_c, len_r = len(sequences[-2]), len(sequences[-1])
            raise PreferenceDataError(
                f"row {row}: the pair has {len_c} + {len_r} = {lengths[row]} tokens > "
                f"schedule.max_tokens={max_tokens}; chosen and rejected share one row, so raise "
                "schedule.max_tokens (or lower dpo.max_length and filter the row)"
            )
    return PairDocuments(sequences, masks, lengths)


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
        raise PreferenceDataError("no pairs to schedule")
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
