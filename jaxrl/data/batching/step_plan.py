"""One optimizer step's documents → this process's device batch: the one planner every trainer
calls.

schedule (``build_dp_schedule``: pack under the token budget, balance over the data-parallel
ranks) → ``docs_per_step`` cut (Fast-LLM: whole rounds until the global document target is
reached; the rest goes back to the feed) → pack (only this process's ranks' rows, the row length
T the smallest of ``row_buckets(max_tokens)`` that holds the longest row) → the ``[R, M, T]``
arrays the train step reads, with the ids used and the ids given back.

Every process builds the same plan from the same inputs (deterministic numpy), so processes
agree on shapes and on which documents a step consumed without talking to each other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxrl.data.batching.packing import PackedBatch, pack_micro_batches, row_buckets
from jaxrl.data.batching.preference import pair_micro_batches
from jaxrl.data.batching.schedule import build_dp_schedule
from jaxrl.data.feed import cut_rounds

DEVICE_FIELDS = ("tokens", "targets", "loss_mask", "segment_ids", "positions", "doc_sample_index")


@dataclasses.dataclass(frozen=True)
class StepBatch:
    """A planned and packed optimizer step."""

    arrays: dict[str, np.ndarray]  # [R, M, ...] in global shape; this process's ranks filled
    rounds: int  # real micro-batches per rank (slots after it are bucket padding)
    micro_batches: list[list[list[int]]]  # [rank][m] document indices into ``sequences``
    used: list[int]  # candidate ids trained on, sorted
    returned: list[int]  # candidate ids not used (docs_per_step cut), in the order offered
    packed: PackedBatch

    @property
    def num_documents(self) -> int:
        """Documents the step trains on, over every rank (the engine checks its count)."""
        return sum(len(mb) for rank in self.micro_batches for mb in rank)


def device_arrays(packed: PackedBatch, extra: Sequence[str] = ()) -> dict[str, np.ndarray]:
    """The ``[R, M, ...]`` arrays the train step reads from a packed batch (plus ``extra``
    token or document fields by name)."""
    arrays = {name: getattr(packed, name) for name in DEVICE_FIELDS}
    for name in extra:
        arrays[name] = packed.token_fields.get(name, packed.doc_fields.get(name))
    return arrays


def step_micro_batches(
    ids: Sequence[int],
    lengths: Any,
    *,
    ranks: int,
    schedule: Any,
    pairs: bool = False,
) -> tuple[list[list[list[int]]], list[int], list[int]]:
    """``(micro_batches, used, returned)`` for candidate ``ids``.

    ``lengths[i]``: tokens of candidate i (with ``pairs``: of pair i's chosen + rejected, and
    the micro-batches list documents ``2i, 2i + 1``). ``schedule``: the ``schedule`` config
    section (``max_tokens``, ``packing``, ``balance``, ``docs_per_step``).
    """
    ids = [int(i) for i in ids]
    if pairs:
        micro_batches = pair_micro_batches(
            ids,
            lengths,
            dp_size=ranks,
            max_tokens=schedule.max_tokens,
            packing=schedule.packing,
            balance=schedule.balance,
        )
        owner = lambda doc: doc // 2  # noqa: E731
    else:
        step = build_dp_schedule(
            [int(lengths[i]) for i in ids],
            dp_size=ranks,
            max_tokens=schedule.max_tokens,
            packing=schedule.packing,
            balance=schedule.balance,
        ).steps[0]
        if step.dropped_rollout_ids:
            raise RuntimeError(f"internal error: the schedule dropped {step.dropped_rollout_ids}")
        micro_batches = [[[ids[j] for j in mb] for mb in rank] for rank in step.micro_batches]
        owner = lambda doc: doc  # noqa: E731
    if schedule.docs_per_step:
        if pairs:
            raise ValueError("schedule.docs_per_step does not apply to preference pairs")
        rounds = cut_rounds(micro_batches, schedule.docs_per_step)
        micro_batches = [rank[:rounds] for rank in micro_batches]
    used = sorted({owner(doc) for rank in micro_batches for mb in rank for doc in mb})
    taken = set(used)
    return micro_batches, used, [i for i in ids if i not in taken]


def plan_device_batch(
    ids: Sequence[int],
    *,
    lengths: Any,
    sequences: Sequence[Any],
    ranks: int,
    schedule: Any,
    pairs: bool = False,
    loss_masks: Sequence[Any] | None = None,
    token_fields: Mapping[str, Sequence[Any]] | None = None,
    doc_fields: Mapping[str, Sequence[float] | np.ndarray] | None = None,
    local_ranks: Sequence[int] | None = None,
) -> StepBatch:
    """Plan (``step_micro_batches``) and pack one step; ``sequences`` etc. are indexed by
    document.

    ``local_ranks``: the ranks this process feeds (``jaxrl.runtime.mesh.local_ranks``); None packs
    every rank. The arrays include ``token_fields`` and ``doc_fields`` by name.
    """
    micro_batches, used, returned = step_micro_batches(
        ids, lengths, ranks=ranks, schedule=schedule, pairs=pairs
    )
    packed = pack_micro_batches(
        micro_batches,
        sequences,
        loss_masks=loss_masks,
        token_fields=token_fields,
        doc_fields=doc_fields,
        row_len=row_buckets(schedule.max_tokens),
        num_slots=tuple(schedule.micro_batch_buckets) or None,
        local_ranks=local_ranks,
    )
    extra = (*(token_fields or {}), *(doc_fields or {}))
    return StepBatch(
        arrays=device_arrays(packed, extra),
        rounds=packed.num_micro_batches,
        micro_batches=micro_batches,
        used=used,
        returned=returned,
        packed=packed,
    )
