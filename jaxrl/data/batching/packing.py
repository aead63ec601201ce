"""Packed device batches ``[R, M, T]`` built from a step's schedule (pure numpy, no jax).

Rank r's m-th micro-batch (a list of global sample indices from
``jaxrl.data.batching.schedule``) becomes row ``[r, m]``: its documents laid end to end, in
micro-batch order, then padding.

Per token (``[R, M, T]``):
- ``tokens``; ``positions`` restart at 0 for every document (0 on padding);
- ``segment_ids``: 1..n for the row's documents in row order, 0 = padding;
- ``targets``: the next token of the same document, 0 where there is none (a document's last
  token, padding);
- ``loss_mask`` (float32): in *target* alignment. Inputs are in *token* alignment (value i describes
  token i, e.g. 1 on completion tokens); position t of the row carries the mask of token t+1 when
  t+1 is in the same document, else 0. So the first token of a document never carries loss (no
  position predicts it) and padding never does. Default mask: all ones, i.e. every next-token
  prediction of every document counts;
- ``token_fields[name]`` (float32, e.g. ``old_logp``): per-token inputs shifted the same way.

Per segment slot (``[R, M, S]``, slot 0 = padding, slots 1..n = the row's documents):
``doc_sample_index`` (-1 where empty) and ``doc_fields[name]`` (float32, e.g. ``advantage``; 0
where empty). Per row (``[R, M]``): ``num_docs``, ``num_tokens`` (real tokens) and
``num_loss_tokens`` (sum of ``loss_mask``).

Static shapes: M (micro-batch slots), T (row length) and S (segment slots) are each chosen by a
bucket spec, so a jitted consumer compiles once per bucket: ``None`` = the next power of two that
fits, an ``int`` = exactly that (error if it does not fit), a sequence = the smallest listed value
that fits. Slots past a rank's real micro-batches are fully padded: segment 0, zero masks and
counts, so they add exactly 0 to every loss numerator and denominator.

Documents are never split: a sample longer than T raises, naming the sample
(docs/algorithms/schedule.md §5.8).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jaxrl.data.batching.schedule import build_dp_schedule

__all__ = [
    "PackedBatch",
    "PackingError",
    "document_index",
    "pack_micro_batches",
    "pack_sequences",
    "pick_bucket",
]

BucketSpec = int | Sequence[int] | None


class PackingError(ValueError):
    """A batch cannot be packed as asked; the message names the sample or row and the fix."""


@dataclass(frozen=True)
class PackedBatch:
    """One step's device batch; see the module docstring for the meaning of every field."""

    tokens: np.ndarray  # int32 [R, M, T]
    positions: np.ndarray  # int32 [R, M, T]
    segment_ids: np.ndarray  # int32 [R, M, T]
    targets: np.ndarray  # int32 [R, M, T]
    loss_mask: np.ndarray  # float32 [R, M, T]
    doc_sample_index: np.ndarray  # int32 [R, M, S]
    num_docs: np.ndarray  # int32 [R, M]
    num_tokens: np.ndarray  # int32 [R, M]
    num_loss_tokens: np.ndarray  # float32 [R, M]
    token_fields: dict[str, np.ndarray] = field(default_factory=dict)  # float32 [R, M, T]
    doc_fields: dict[str, np.ndarray] = field(default_factory=dict)  # float32 [R, M, S]
    num_micro_batches: int = 0  # real micro-batches per rank (slots past it are padding)

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(R, M, T)``."""
        return self.tokens.shape  # type: ignore[return-value]

    @property
    def num_segments(self) -> int:
        """S, the static number of segment slots (slot 0 is padding)."""
        return int(self.doc_sample_index.shape[-1])

    def split_by_sample(self, values_RMT: np.ndarray) -> dict[int, np.ndarray]:
        """Cut a per-token array laid out like ``tokens`` back into per-sample arrays, keyed by
        global sample index (e.g. to read per-document log-probs after evaluation)."""
        out: dict[int, np.ndarray] = {}
        for r, k, slot in zip(*np.nonzero(self.doc_sample_index >= 0), strict=True):
            if slot == 0:
                continue
            mask = self.segment_ids[r, k] == slot
            out[int(self.doc_sample_index[r, k, slot])] = np.asarray(values_RMT[r, k][mask])
        return out


def pick_bucket(needed: int, spec: BucketSpec, name: str) -> int:
    """The static size for a dimension that needs ``needed`` (>= 1) entries.

    ``None``: next power of two >= needed; ``int``: exactly that value; sequence: the smallest
    listed value >= needed. Raises ``PackingError`` naming the dimension when nothing fits.
    """
    needed = max(int(needed), 1)
    if spec is None:
        return 1 << (needed - 1).bit_length()
    if isinstance(spec, int | np.integer):
        if needed > spec:
            raise PackingError(f"{name}: need {needed} but it is fixed at {int(spec)}")
        return int(spec)
    fitting = sorted(int(b) for b in spec if b >= needed)
    if not fitting:
        raise PackingError(f"{name}: need {needed}, larger than every bucket in {list(spec)}")
    return fitting[0]


def row_buckets(max_tokens: int, smallest: int = 64) -> tuple[int, ...]:
    """Row lengths T a step may use under a ``max_tokens`` budget: ``smallest``, then powers of
    two, 384, and from 512 up quarter steps (64, 128, 256, 384, 512, 640, 768, 896, 1024, 1280,
    1536, 1792, 2048, ...) below the budget, then the budget itself.

    Trainers pack with ``row_len=row_buckets(max_tokens)``, so T is the smallest bucket that
    holds the step's longest row, not the budget: raising the budget to pack better does not
    pad every row to it. From 256 up a row is over 2/3 full, from 512 up over 4/5 (556 tokens →
    640, not 768: the dense layers and the head run on padding too), and every bucket from 128
    up is a multiple of 128, the block of the TPU and GPU attention kernels. Each bucket is one
    compiled program (the step counts them; the persistent compile cache keeps them).
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens} must be positive")
    sizes = []
    size = smallest
    while size < max_tokens:
        if size >= 512:
            steps = (size, size * 5 // 4, size * 3 // 2, size * 7 // 4)
        elif size >= 256:
            steps = (size, size * 3 // 2)
        else:
            steps = (size,)
        sizes.extend(s for s in steps if s < max_tokens)
        size *= 2
    return (*sizes, max_tokens)


def document_index(lengths: Sequence[int], row_len: int) -> np.ndarray:
    """1-based document index of every position of a row holding ``lengths`` then padding.

    Padding is clamped onto the last document (Fast-LLM's fix, docs/algorithms/accumulation.md
    §4), so the
    index never exceeds ``len(lengths)``: ``[3, 4]`` padded to 10 ->
    ``[1,1,1,2,2,2,2,2,2,2]``. A row with no document is all 0. int32 ``[row_len]``.
    """
    ends = np.cumsum(np.asarray(lengths, dtype=np.int64))
    if ends.size and ends[-1] > row_len:
        raise PackingError(f"documents of {int(ends[-1])} tokens do not fit row_len={row_len}")
    index = np.searchsorted(ends, np.arange(row_len), side="right") + 1
    return np.minimum(index, len(ends)).astype(np.int32)


def _largest(spec: BucketSpec) -> int | None:
    if spec is None:
        return None
    if isinstance(spec, int | np.integer):
        return int(spec)
    return max(int(b) for b in spec)


def _per_sample(name: str, values: Any, i: int, length: int) -> np.ndarray:
    arr = np.asarray(values[i], dtype=np.float32)
    if arr.shape != (length,):
        raise PackingError(
            f"{name} of sample {i} has shape {arr.shape}, but the sample has {length} tokens "
            "(per-token inputs are token-aligned: one value per token)"
        )
    return arr


def pack_micro_batches(
    micro_batches: Any,
    sequences: Sequence[Any],
    *,
    loss_masks: Sequence[Any] | None = None,
    token_fields: Mapping[str, Sequence[Any]] | None = None,
    doc_fields: Mapping[str, Sequence[float] | np.ndarray] | None = None,
    row_len: BucketSpec = None,
    num_slots: BucketSpec = None,
    num_segments: BucketSpec = None,
    local_ranks: Sequence[int] | None = None,
) -> PackedBatch:
    """Pack ``micro_batches[r][m]`` (global sample indices) into a ``PackedBatch``.

    Args:
      micro_batches: a ``StepSchedule`` (its ``micro_batches`` are used) or nested lists
        ``[R][M][docs]``; every rank must have the same number M of micro-batches. Pass a slice of
        ranks to pack only this host's part.
      sequences: token ids of every sample, indexed by global sample index.
      loss_masks: optional token-aligned loss mask per sample (default all ones).
      token_fields: optional name -> token-aligned float values per sample (e.g. ``old_logp``).
      doc_fields: optional name -> one float per sample (e.g. ``advantage``).
      row_len, num_slots, num_segments: bucket specs (see ``pick_bucket``) for T, M and S.
        Trainers pass ``row_len=max_tokens`` so every step has the same T.
      local_ranks: fill only these ranks' rows (one process's share of a multi-process step);
        the shapes still follow every rank, so all processes agree on them. None = all.

    Raises:
      PackingError: a sample longer than T (naming it), a row over T, unequal micro-batch counts,
        per-token inputs of the wrong length, or a dimension no bucket fits.
    """
    mbs = getattr(micro_batches, "micro_batches", micro_batches)
    num_ranks = len(mbs)
    counts = {len(rank) for rank in mbs}
    if num_ranks == 0 or len(counts) != 1:
        raise PackingError(
            f"every rank needs the same number of micro-batches, got {[len(r) for r in mbs]}"
        )
    num_real = counts.pop()
    length_of: dict[int, int] = {}
    for rank in mbs:
        for mb in rank:
            for i in mb:
                length_of[int(i)] = n = len(sequences[i])
                if n == 0:
                    raise PackingError(f"sample {int(i)} is empty: every document needs a token")
    limit = _largest(row_len)
    if limit is not None:
        for i, n in length_of.items():
            if n > limit:
                raise PackingError(
                    f"sample {i} has {n} tokens > row length T={limit}: documents are never "
                    "split; raise max_tokens (row_len) or filter the sample upstream (max_seq_len)"
                )
    row_tokens = [[sum(length_of[int(i)] for i in mb) for mb in rank] for rank in mbs]
    for r, rank_tokens in enumerate(row_tokens):
        for m, n in enumerate(rank_tokens):
            if limit is not None and n > limit:
                raise PackingError(
                    f"rank {r} micro-batch {m} holds {n} tokens > row length T={limit} (samples "
                    f"{list(mbs[r][m])}); schedule with a token budget <= T"
                )
    T = pick_bucket(
        max((max(t, default=1) for t in row_tokens), default=1), row_len, "row length T"
    )
    M = pick_bucket(num_real, num_slots, "micro-batch slots M")
    S = pick_bucket(
        max((len(mb) for rank in mbs for mb in rank), default=0) + 1,
        num_segments,
        "segment slots S",
    )
    shape, dshape = (num_ranks, M, T), (num_ranks, M, S)
    tokens = np.zeros(shape, np.int32)
    positions = np.zeros(shape, np.int32)
    segment_ids = np.zeros(shape, np.int32)
    targets = np.zeros(shape, np.int32)
    loss_mask = np.zeros(shape, np.float32)
    tfields = {name: np.zeros(shape, np.float32) for name in token_fields or {}}
    dfields = {name: np.zeros(dshape, np.float32) for name in doc_fields or {}}
    doc_sample_index = np.full(dshape, -1, np.int32)
    num_docs = np.zeros((num_ranks, M), np.int32)
    num_tokens = np.zeros((num_ranks, M), np.int32)
    fill = range(num_ranks) if local_ranks is None else sorted(set(local_ranks))
    for r in fill:
        for m, mb in enumerate(mbs[r]):
            idx = [int(i) for i in mb]
            lens = [length_of[i] for i in idx]
            n, d = sum(lens), len(idx)
            if d == 0:
                raise PackingError(f"rank {r} micro-batch {m} is empty")
            docs = [np.asarray(sequences[i]) for i in idx]
            if any(doc.ndim != 1 for doc in docs):
                raise PackingError(f"token ids of samples {idx} must be 1-D sequences")
            toks = np.concatenate(docs)
            if toks.dtype.kind not in "iu":
                raise PackingError(f"token ids of samples {idx} are not integers ({toks.dtype})")
            seg = np.repeat(np.arange(1, d + 1, dtype=np.int32), lens)
            starts = np.repeat(np.cumsum([0, *lens[:-1]]), lens)
            same_doc_next = seg[1:] == seg[:-1]  # position t predicts token t+1 of its document
            tokens[r, m, :n] = toks
            positions[r, m, :n] = np.arange(n) - starts
            segment_ids[r, m, :n] = seg
            targets[r, m, : n - 1] = np.where(same_doc_next, toks[1:], 0)
            if loss_masks is not None:
                mask = np.concatenate(
                    [
                        _per_sample("loss_mask", loss_masks, i, ln)
                        for i, ln in zip(idx, lens, strict=True)
                    ]
                )
                loss_mask[r, m, : n - 1] = np.where(same_doc_next, mask[1:], 0.0)
            else:
                loss_mask[r, m, : n - 1] = same_doc_next
            for name, values in (token_fields or {}).items():
                vals = np.concatenate(
                    [_per_sample(name, values, i, ln) for i, ln in zip(idx, lens, strict=True)]
                )
                tfields[name][r, m, : n - 1] = np.where(same_doc_next, vals[1:], 0.0)
            doc_sample_index[r, m, 1 : d + 1] = idx
            for name, values in (doc_fields or {}).items():
                dfields[name][r, m, 1 : d + 1] = [float(values[i]) for i in idx]
            num_docs[r, m], num_tokens[r, m] = d, n
    return PackedBatch(
        tokens=tokens,
        positions=positions,
        segment_ids=segment_ids,
        targets=targets,
        loss_mask=loss_mask,
        doc_sample_index=doc_sample_index,
        num_docs=num_docs,
        num_tokens=num_tokens,
        num_loss_tokens=loss_mask.sum(axis=-1, dtype=np.float32),
        token_fields=tfields,
        doc_fields=dfields,
        num_micro_batches=num_real,
    )


def pack_sequences(
    sequences: Sequence[Any],
    *,
    row_len: int,
    loss_masks: Sequence[Any] | None = None,
    token_fields: Mapping[str, Sequence[Any]] | None = None,
    doc_fields: Mapping[str, Sequence[float] | np.ndarray] | None = None,
    packing: str = "ffd",
    num_slots: BucketSpec = None,
    num_segments: BucketSpec = None,
) -> PackedBatch:
    """Pack a plain list of sequences into rows of ``row_len`` tokens for one rank (R = 1).

    For evaluation and tests: the rows come from ``build_dp_schedule`` with ``dp_size=1`` and
    ``max_tokens=row_len`` (``packing`` as there), then go through ``pack_micro_batches``, the
    same path as training. ``doc_sample_index`` maps documents back to list positions.
    """
    lengths = [len(s) for s in sequences]
    for i, n in enumerate(lengths):
        if n > row_len:
            raise PackingError(
                f"sample {i} has {n} tokens > row length T={row_len}: documents are never split"
            )
    sched = build_dp_schedule(
        lengths, dp_size=1, max_tokens=row_len, packing=packing, balance="strided"
    )
    return pack_micro_batches(
        sched.steps[0],
        sequences,
        loss_masks=loss_masks,
        token_fields=token_fields,
        doc_fields=doc_fields,
        row_len=row_len,
        num_slots=num_slots,
        num_segments=num_segments,
    )
