"""Shared-prompt packing (``grpo.shared_prompt_packing``): a GRPO step whose completions of one
prompt are trained against ONE copy of that prompt per row (pure numpy, no jax).

Unshared, every completion is a document ``prompt + completion``, so a row of G completions of
a P-token prompt trains the prompt G times. Shared, a *unit* (a prompt and some of its
completions, the ``c_i``) is laid out as::

    [prompt[:-1]]            segment A:   positions 0 .. P-2, no loss, not a document
    [prompt[-1], c_1 ...]    segment B_1: positions P-1, P, ...; parent A
    [prompt[-1], c_2 ...]    segment B_2: positions P-1, P, ...; parent A  ...

``parent_ids`` (int32 ``[R, M, T]``) holds, per token, the segment it also sees in full (A for
a B token, 0 otherwise); the attention lets a B token see its own segment causally and all of A
(docs/attention.md). Each B_i starts with the copied last prompt token, so the position that
predicts ``c_i[0]`` is B_i's own, and B_i carries exactly what the completion part of the
unshared document carries: its targets, loss mask and token fields (target-aligned, as
``packing.pack_micro_batches`` shifts them), its ``doc_sample_index`` and document fields. A
carries the prompt's values (token fields included, also at its last position, where a
forward-read field such as a MoE route of token P-2 must stay), target 0 at its last position,
loss mask 0, ``doc_sample_index`` -1 and document fields 0; the losses do not count it as a
document (``jaxrl.losses.normalize.documents_present`` with ``parent_ids``). So every loss,
metric and count equals the unshared layout's: the step is the same update, on fewer tokens
(docs/algorithms/grpo.md §12).

Which documents share: those of the same ``group_keys`` value (the trainer's: the generation
batch) with identical prompt tokens, no loss on the prompt and identical token-field values on
it (so the one copy is every document's prompt). A unit costs ``P - 1 + Σ (1 + C_i)`` tokens; a
group that does not fit ``schedule.max_tokens`` is cut into units in order, each with its own
copy of the prompt; a unit of one document is laid out as the plain document. The units go
through the same schedule (``build_dp_schedule``: budget, balance over ranks, alignment) at
their true cost; when they cannot fill every rank's aligned micro-batches (or the schedule
would drop one), the units are halved and scheduled again, down to one document per unit,
which is exactly the unshared schedule. The ``docs_per_step`` cut counts documents, never
prompt segments. Deterministic: no RNG, orders follow the offered ids.

Scoring (GRPO's old / reference log-probs at generation, ``Scorer.token_logprobs``):
``pack_shared_sequences`` lays a list of documents out the same way into rows of one length, and
``split_shared_by_sample`` reads per-token values back per document, prompt included.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import numpy as np

from jaxrl.data.batching.binpack import ScheduleError
from jaxrl.data.batching.packing import (
    PackedBatch,
    PackingError,
    _largest,
    _per_sample,
    pick_bucket,
    row_buckets,
)
from jaxrl.data.batching.schedule import build_dp_schedule
from jaxrl.data.batching.step_plan import StepBatch, device_arrays
from jaxrl.data.feed import cut_rounds

__all__ = [
    "PARENT_FIELD",
    "SharedPackedBatch",
    "pack_shared_sequences",
    "plan_shared_batch",
    "prompt_units",
    "schedule_units",
    "split_shared_by_sample",
]

PARENT_FIELD = "parent_ids"  # the micro-batch field the attention and the losses read


@dataclasses.dataclass(frozen=True)
class SharedPackedBatch(PackedBatch):
    """A ``PackedBatch`` in the shared-prompt layout: ``parent_ids`` int32 ``[R, M, T]``;
    ``doc_sample_index`` is -1 on a prompt segment and ``num_docs`` counts documents only."""

    parent_ids: np.ndarray | None = None
    tokens_unshared: int = 0  # tokens the same documents take unshared (all ranks)
    trained_tokens: int = 0  # tokens of this layout (all ranks)


def _shareable_key(
    i: int,
    sequences: Sequence[Any],
    prompt_lengths: Sequence[int],
    loss_masks: Sequence[Any] | None,
    token_fields: Mapping[str, Sequence[Any]],
) -> bytes | None:
    """What two documents must agree on to share a prompt copy (None: it cannot share)."""
    p = int(prompt_lengths[i])
    seq = np.asarray(sequences[i])
    if p < 2 or p >= len(seq):  # nothing to share, or no completion token
        return None
    if loss_masks is None or np.any(np.asarray(loss_masks[i], np.float32)[1:p] != 0):
        return None  # a loss on the prompt (the default mask has one): the copy would drop it
    parts = [np.asarray(seq[:p], np.int64).tobytes()]
    for name in sorted(token_fields):
        parts.append(np.asarray(token_fields[name][i], np.float32)[:p].tobytes())
    return b"\0".join(parts)


def prompt_units(
    ids: Sequence[int],
    *,
    sequences: Sequence[Any],
    prompt_lengths: Sequence[int],
    group_keys: Sequence[Hashable],
    max_tokens: int,
    loss_masks: Sequence[Any] | None = None,
    token_fields: Mapping[str, Sequence[Any]] | None = None,
) -> list[list[int]]:
    """The packing units of candidate ``ids``: lists of document ids (indices into
    ``sequences``), each a prompt group's documents in offered order, cut in order so a unit's
    cost ``P - 1 + Σ (1 + C_i)`` stays within ``max_tokens``; units in first-occurrence order.
    ``group_keys[i]``: documents share only within one key (e.g. their generation batch)."""
    fields = token_fields or {}
    groups: dict[Any, list[int]] = {}
    for i in (int(x) for x in ids):
        key = _shareable_key(i, sequences, prompt_lengths, loss_masks, fields)
        groups.setdefault(("alone", i) if key is None else (group_keys[i], key), []).append(i)
    units: list[list[int]] = []
    for docs in groups.values():
        p = int(prompt_lengths[docs[0]])
        unit: list[int] = []
        cost = p - 1
        for i in docs:
            add = len(sequences[i]) - p + 1
            if unit and cost + add > max_tokens:
                units.append(unit)
                unit, cost = [], p - 1
            unit.append(i)
            cost += add
        units.append(unit)
    return units


def unit_cost(unit: Sequence[int], sequences: Sequence[Any], prompt_lengths: Sequence[int]) -> int:
    """Tokens of a unit's layout: the plain document alone, else ``P - 1 + Σ (1 + C_i)``."""
    if len(unit) == 1:
        return len(sequences[unit[0]])
    p = int(prompt_lengths[unit[0]])
    return p - 1 + sum(len(sequences[i]) - p + 1 for i in unit)


def _halve(units: list[list[int]]) -> list[list[int]]:
    """Every unit of several documents cut into two halves (in order)."""
    out: list[list[int]] = []
    for u in units:
        if len(u) > 1:
            out += [u[: len(u) // 2], u[len(u) // 2 :]]
        else:
            out.append(u)
    return out


def schedule_units(
    units: list[list[int]],
    costs_of: Any,
    *,
    ranks: int,
    schedule: Any,
) -> tuple[list[list[int]], list[list[list[int]]]]:
    """``(units, micro_batches)``: the schedule's micro-batches ``[rank][m]`` of unit indices
    (into the returned units). Units are split (the largest first until every rank can have
    one, then all halved) until ``build_dp_schedule`` places them all; one document per unit is
    the unshared schedule, whose errors it then raises."""
    units = [list(u) for u in units]
    while len(units) < ranks and any(len(u) > 1 for u in units):
        j = max(range(len(units)), key=lambda k: (len(units[k]), -k))
        u = units[j]
        units[j : j + 1] = [u[: len(u) // 2], u[len(u) // 2 :]]
    while True:
        single = all(len(u) == 1 for u in units)
        try:
            step = build_dp_schedule(
                [costs_of(u) for u in units],
                dp_size=ranks,
                max_tokens=schedule.max_tokens,
                packing=schedule.packing,
                balance=schedule.balance,
            ).steps[0]
        except ScheduleError:
            if single:
                raise
            units = _halve(units)
            continue
        if not step.dropped_rollout_ids:
            return units, step.micro_batches
        if single:
            raise RuntimeError(f"internal error: the schedule dropped {step.dropped_rollout_ids}")
        units = _halve(units)


def plan_shared_batch(
    ids: Sequence[int],
    *,
    sequences: Sequence[Any],
    prompt_lengths: Sequence[int],
    group_keys: Sequence[Hashable],
    ranks: int,
    schedule: Any,
    loss_masks: Sequence[Any] | None = None,
    token_fields: Mapping[str, Sequence[Any]] | None = None,
    doc_fields: Mapping[str, Sequence[float] | np.ndarray] | None = None,
    local_ranks: Sequence[int] | None = None,
) -> StepBatch:
    """``step_plan.plan_device_batch`` in the shared-prompt layout: the same ``StepBatch``
    (``micro_batches`` list documents, prompt segments left out; ``used`` / ``returned``
    document ids), its arrays with ``parent_ids``."""
    ids = [int(i) for i in ids]
    units = prompt_units(
        ids,
        sequences=sequences,
        prompt_lengths=prompt_lengths,
        group_keys=group_keys,
        max_tokens=schedule.max_tokens,
        loss_masks=loss_masks,
        token_fields=token_fields,
    )
    units, unit_mbs = schedule_units(
        units,
        lambda u: unit_cost(u, sequences, prompt_lengths),
        ranks=ranks,
        schedule=schedule,
    )
    layout = [[[units[j] for j in mb] for mb in rank] for rank in unit_mbs]
    doc_mbs = [[[i for u in mb for i in u] for mb in rank] for rank in layout]
    if schedule.docs_per_step:
        rounds = cut_rounds(doc_mbs, schedule.docs_per_step)
        layout = [rank[:rounds] for rank in layout]
        doc_mbs = [rank[:rounds] for rank in doc_mbs]
    used = sorted({i for rank in doc_mbs for mb in rank for i in mb})
    taken = set(used)
    packed = pack_shared(
        layout,
        sequences,
        prompt_lengths,
        loss_masks=loss_masks,
        token_fields=token_fields,
        doc_fields=doc_fields,
        row_len=row_buckets(schedule.max_tokens),
        num_slots=tuple(schedule.micro_batch_buckets) or None,
        local_ranks=local_ranks,
    )
    extra = (*(token_fields or {}), *(doc_fields or {}))
    arrays = device_arrays(packed, extra)
    arrays[PARENT_FIELD] = packed.parent_ids
    return StepBatch(
        arrays=arrays,
        rounds=packed.num_micro_batches,
        micro_batches=doc_mbs,
        used=used,
        returned=[i for i in ids if i not in taken],
        packed=packed,
    )


def _segments(
    unit: Sequence[int],
    sequences: Sequence[Any],
    prompt_lengths: Sequence[int],
) -> list[tuple[int, int, int, int]]:
    """A unit's segments as ``(doc, start, stop, position offset)``: token range of the
    document ``doc`` laid out from position ``offset``; the prompt segment first (doc -1 marks
    it, its tokens those of the unit's first document)."""
    if len(unit) == 1:
        return [(unit[0], 0, len(sequences[unit[0]]), 0)]
    p = int(prompt_lengths[unit[0]])
    out = [(-1, 0, p - 1, 0)]
    return out + [(i, p - 1, len(sequences[i]), p - 1) for i in unit]


def pack_shared(
    layout: list[list[list[list[int]]]],
    sequences: Sequence[Any],
    prompt_lengths: Sequence[int],
    *,
    loss_masks: Sequence[Any] | None = None,
    token_fields: Mapping[str, Sequence[Any]] | None = None,
    doc_fields: Mapping[str, Sequence[float] | np.ndarray] | None = None,
    row_len: Any = None,
    num_slots: Any = None,
    local_ranks: Sequence[int] | None = None,
) -> SharedPackedBatch:
    """Pack ``layout[r][m]`` (units, each a list of document ids) into rows (module
    docstring); buckets and errors as ``packing.pack_micro_batches``."""
    num_ranks = len(layout)
    counts = {len(rank) for rank in layout}
    if num_ranks == 0 or len(counts) != 1:
        raise PackingError(
            f"every rank needs the same number of micro-batches, got {[len(r) for r in layout]}"
        )
    num_real = counts.pop()
    segs = [[[s for u in mb for s in _segments(u, sequences, prompt_lengths)] for mb in rank]
            for rank in layout]  # fmt: skip
    limit = _largest(row_len)
    for rank in segs:
        for mb in rank:
            for doc, lo, hi, _ in mb:
                if limit is not None and lo == 0 and hi > limit and doc >= 0:
                    raise PackingError(
                        f"sample {doc} has {hi} tokens > row length T={limit}: documents are "
                        "never split; raise max_tokens (row_len) or filter the sample upstream "
                        "(max_seq_len)"
                    )
    row_tokens = [sum(hi - lo for _, lo, hi, _ in mb) for rank in segs for mb in rank]
    if limit is not None and max(row_tokens, default=0) > limit:
        raise PackingError(f"a micro-batch holds {max(row_tokens)} tokens > row length {limit}")
    T = pick_bucket(max(row_tokens, default=1), row_len, "row length T")
    M = pick_bucket(num_real, num_slots, "micro-batch slots M")
    S = pick_bucket(max((len(mb) for r in segs for mb in r), default=0) + 1, None, "segments S")
    shape, dshape = (num_ranks, M, T), (num_ranks, M, S)
    out = {k: np.zeros(shape, np.int32) for k in ("tokens", "positions", "segment_ids")}
    out["targets"], out["parent_ids"] = np.zeros(shape, np.int32), np.zeros(shape, np.int32)
    loss_mask = np.zeros(shape, np.float32)
    tfields = {name: np.zeros(shape, np.float32) for name in token_fields or {}}
    dfields = {name: np.zeros(dshape, np.float32) for name in doc_fields or {}}
    doc_index = np.full(dshape, -1, np.int32)
    num_docs = np.zeros((num_ranks, M), np.int32)
    num_tokens = np.zeros((num_ranks, M), np.int32)
    fill = range(num_ranks) if local_ranks is None else sorted(set(local_ranks))
    for r in fill:
        for m, mb in enumerate(segs[r]):
            at, parent = 0, 0
            for s, (doc, lo, hi, offset) in enumerate(mb, start=1):
                src = doc if doc >= 0 else next(d for d, *_ in mb[s:] if d >= 0)
                seq = np.asarray(sequences[src])
                n = hi - lo
                row = slice(at, at + n)
                out["tokens"][r, m, row] = seq[lo:hi]
                out["positions"][r, m, row] = offset + np.arange(n)
                out["segment_ids"][r, m, row] = s
                out["targets"][r, m, at : at + n - 1] = seq[lo + 1 : hi]
                if doc < 0:  # the prompt segment: its values, also at its last position
                    parent = s
                    for name, values in (token_fields or {}).items():
                        vals = _per_sample(name, values, src, len(seq))
                        tfields[name][r, m, row] = vals[lo + 1 : hi + 1]
                else:
                    is_b = lo > 0
                    out["parent_ids"][r, m, row] = parent if is_b else 0
                    if loss_masks is not None:
                        mask = _per_sample("loss_mask", loss_masks, doc, len(seq))
                        loss_mask[r, m, at : at + n - 1] = mask[lo + 1 : hi]
                    else:
                        loss_mask[r, m, at : at + n - 1] = 1.0
                    for name, values in (token_fields or {}).items():
                        vals = _per_sample(name, values, doc, len(seq))
                        tfields[name][r, m, at : at + n - 1] = vals[lo + 1 : hi]
                    doc_index[r, m, s] = doc
                    for name, values in (doc_fields or {}).items():
                        dfields[name][r, m, s] = float(values[doc])
                    num_docs[r, m] += 1
                at += n
            num_tokens[r, m] = at
    unshared = sum(len(sequences[i]) for rank in layout for mb in rank for u in mb for i in u)
    return SharedPackedBatch(
        tokens=out["tokens"],
        positions=out["positions"],
        segment_ids=out["segment_ids"],
        targets=out["targets"],
        loss_mask=loss_mask,
        doc_sample_index=doc_index,
        num_docs=num_docs,
        num_tokens=num_tokens,
        num_loss_tokens=loss_mask.sum(axis=-1, dtype=np.float32),
        token_fields=tfields,
        doc_fields=dfields,
        num_micro_batches=num_real,
        parent_ids=out["parent_ids"],
        tokens_unshared=int(unshared),
        trained_tokens=int(sum(row_tokens)),
    )


def pack_shared_sequences(
    sequences: Sequence[Any],
    prompt_lengths: Sequence[int],
    *,
    row_len: int,
    loss_masks: Sequence[Any] | None = None,
    token_fields: Mapping[str, Sequence[Any]] | None = None,
    group_keys: Sequence[Hashable] | None = None,
    packing: str = "ffd",
) -> SharedPackedBatch:
    """``packing.pack_sequences`` in the shared-prompt layout, for scoring (one rank): the
    documents' units (``prompt_units``, ``group_keys`` default: all one group) scheduled into
    rows of ``row_len`` tokens (``schedule_units``) and laid out by ``pack_shared``. One change
    for scoring: a prompt segment's last position targets the prompt's last token (the token
    its copies start with; loss mask 0 still), so ``split_shared_by_sample`` of the scored
    log-probs has every token's value of the unshared layout."""
    ids = range(len(sequences))
    keys = [0] * len(sequences) if group_keys is None else group_keys
    units = prompt_units(
        ids,
        sequences=sequences,
        prompt_lengths=prompt_lengths,
        group_keys=keys,
        max_tokens=row_len,
        loss_masks=loss_masks,
        token_fields=token_fields,
    )
    schedule = types.SimpleNamespace(max_tokens=row_len, packing=packing, balance="strided")
    units, unit_mbs = schedule_units(
        units, lambda u: unit_cost(u, sequences, prompt_lengths), ranks=1, schedule=schedule
    )
    packed = pack_shared(
        [[[units[j] for j in mb] for mb in rank] for rank in unit_mbs],
        sequences,
        prompt_lengths,
        loss_masks=loss_masks,
        token_fields=token_fields,
        row_len=row_len,
    )
    seg, parent = packed.segment_ids, packed.parent_ids
    last = np.zeros_like(seg, bool)  # a segment's last token: the next token is another's
    last[..., :-1] = seg[..., :-1] != seg[..., 1:]
    is_parent = np.zeros_like(seg, bool)
    for r, m in np.ndindex(seg.shape[:2]):
        is_parent[r, m] = np.isin(seg[r, m], parent[r, m][parent[r, m] > 0])
    at = last & is_parent  # never a row's final token: a prompt copy's children follow it
    packed.targets[..., :-1][at[..., :-1]] = packed.tokens[..., 1:][at[..., :-1]]
    return packed


def split_shared_by_sample(
    packed: SharedPackedBatch, values_RMT: np.ndarray
) -> dict[int, np.ndarray]:
    """``PackedBatch.split_by_sample`` of the shared layout: per document (by sample index),
    the values at its tokens' positions, its prompt's from the prompt segment it sees, so each
    array is as long as the document."""
    out: dict[int, np.ndarray] = {}
    values_RMT = np.asarray(values_RMT)
    for r, m, slot in zip(*np.nonzero(packed.doc_sample_index >= 0), strict=True):
        if slot == 0:
            continue
        seg_T, vals_T = packed.segment_ids[r, m], values_RMT[r, m]
        own = seg_T == slot
        parent = int(packed.parent_ids[r, m][own][0])
        head = vals_T[seg_T == parent] if parent > 0 else vals_T[:0]
        out[int(packed.doc_sample_index[r, m, slot])] = np.concatenate([head, vals_T[own]])
    return out
