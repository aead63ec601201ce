"""Host-side data-parallel micro-batch schedule (slime PR #2065). Pure numpy.

``build_dp_schedule`` decides, per optimizer step, which samples go into which micro-batch on
which data-parallel rank. Two faces:

- slime mode (``packing="first_fit", balance="strided"``) reproduces THUDM/slime's
  ``build_dp_schedule`` (main plus the drop loop of PR #2065) bit for bit; ``to_slime()`` returns
  its four outputs.
- default mode (``packing="ffd", balance="cost"``): first-fit-decreasing packing and cost-balanced
  distribution (greedy, then swaps between the heaviest rank and the others), with the same
  contract.

Invariants of every schedule (docs/algorithms/schedule.md §5.9), checked by
tests/test_schedule_properties.py:

- every rank has the same number ``n[s]`` of micro-batches in step s, ``n[s] >= 1`` and
  ``n[s] % micro_batch_group == 0``; micro-batches are never empty;
- the kept samples of step s are exactly the samples of a prefix of whole rollouts (whole prompt
  groups with ``group_ids``) of the step's rollouts, each placed exactly once; dropped (3.4) and
  leftover (past the last whole step) rollouts are reported on the schedule and logged as
  warnings on logger ``"jaxrl.schedule"``, never silently lost;
- dynamic mode: a micro-batch holds ``<= max_tokens`` tokens or exactly one sample;
- rollouts are dropped only in dynamic mode with ``align_to = dp_size * micro_batch_group > 1``,
  and only the minimum number of trailing rollouts that makes the aligned target reachable;
- the result is deterministic (no RNG, no dependence on hashing or on id values beyond their
  first-occurrence order).

Default mode guarantee (versus slime mode on the same input): for every prefix of a step the
default packing's aligned micro-batch target is never larger than first-fit's, because the FFD
bins are replaced by the first-fit bins whenever first-fit gives a strictly smaller aligned target
(FFD is usually, not always, at least as good: e.g. ``[6,2,2,2,3,5]``, cap 10). Hence, whenever
slime mode succeeds, default mode succeeds too, keeps at least as many rollouts in every step,
never uses more micro-batches than first-fit needs for the samples it keeps, and, when it keeps
the same rollouts as slime mode, uses no more micro-batches. When FFD avoids a drop that slime
mode makes, default mode keeps the extra rollouts and may need more micro-batches for them:
minimal drop (docs/algorithms/schedule.md §5.9) takes precedence over a smaller micro-batch count.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np

from jaxrl.data.batching.binpack import ScheduleError, StepPlan, plan_step

__all__ = ["DPSchedule", "ScheduleError", "StepSchedule", "StepStats", "build_dp_schedule"]

logger = logging.getLogger("jaxrl.schedule")

PACKINGS = ("ffd", "first_fit")
BALANCES = ("cost", "strided", "kk")


@dataclass(frozen=True)
class StepStats:
    """Per-step statistics (docs/algorithms/schedule.md §5.7). Costs are
    ``len + attn_coef * len**2`` summed."""

    num_micro_batches: int  # per rank, equal on all ranks
    num_samples: int  # kept samples
    num_rollouts: int  # kept rollouts (slime's global_batch_sizes entry)
    num_dropped_rollouts: int
    num_dropped_samples: int
    tokens_per_rank: list[int]
    cost_per_rank: list[float]
    fill_efficiency: float  # tokens / (micro-batches * max_tokens); static: samples / slots
    imbalance: float  # max rank cost / mean rank cost - 1
    max_micro_batch_tokens: int


@dataclass(frozen=True)
class StepSchedule:
    """One optimizer step. ``micro_batches[r][m]`` lists the GLOBAL sample indices of rank r's
    m-th micro-batch; every rank has ``stats.num_micro_batches`` of them."""

    micro_batches: list[list[list[int]]]
    bins: list[list[int]]  # the aligned bin list (global indices); micro_batches[r][m] is one
    rank_bins: list[list[int]]  # bin ids per rank: micro_batches[r][m] == bins[rank_bins[r][m]]
    sample_indices: list[int]  # kept samples, in step order (rollout by rollout)
    rollout_ids: list[Hashable]  # kept rollouts, in order
    dropped_rollout_ids: list[Hashable]  # trailing rollouts removed by the drop loop
    stats: StepStats

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per rank."""
        return self.stats.num_micro_batches


@dataclass(frozen=True)
class DPSchedule:
    """The schedule of every step, plus what was dropped or left over."""

    steps: list[StepSchedule]
    dp_size: int
    max_tokens: int | None
    micro_batch_size: int | None
    micro_batch_group: int
    rollouts_per_step: int
    packing: str
    balance: str
    num_samples: int  # N, all input samples
    leftover_rollout_ids: list[Hashable]  # rollouts past the last whole step
    num_leftover_samples: int

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    @property
    def kept_rollout_ids(self) -> list[Hashable]:
        return [rid for step in self.steps for rid in step.rollout_ids]

    @property
    def dropped_rollout_ids(self) -> list[Hashable]:
        return [rid for step in self.steps for rid in step.dropped_rollout_ids]

    @property
    def num_kept_samples(self) -> int:
        return sum(step.stats.num_samples for step in self.steps)

    @property
    def num_dropped_samples(self) -> int:
        return sum(step.stats.num_dropped_samples for step in self.steps)

    def to_slime(self) -> tuple[list[list[int]], list[list[list[int]]], list[int], list[int]]:
        """``(partitions, micro_batch_indices, num_microbatches, global_batch_sizes)`` exactly as
        slime returns them (docs/algorithms/schedule.md §2): global indices per rank, local
        consecutive ranges
        continuing across steps, micro-batches per rank per step, kept rollouts per step."""
        partitions: list[list[int]] = [[] for _ in range(self.dp_size)]
        micro_batch_indices: list[list[list[int]]] = [[] for _ in range(self.dp_size)]
        for step in self.steps:
            for r, rank_mbs in enumerate(step.micro_batches):
                for mb in rank_mbs:
                    start = len(partitions[r])
                    partitions[r].extend(mb)
                    micro_batch_indices[r].append(list(range(start, start + len(mb))))
        num_microbatches = [step.num_micro_batches for step in self.steps]
        global_batch_sizes = [step.stats.num_rollouts for step in self.steps]
        return partitions, micro_batch_indices, num_microbatches, global_batch_sizes

    def metrics(self, step: int) -> dict[str, float]:
        """Scalar metrics for step ``step``. Leftovers happen once per schedule and are reported
        on step 0 only, so summing the metrics over steps counts them once."""
        st = self.steps[step].stats
        return {
            "schedule/num_micro_batches": float(st.num_micro_batches * self.dp_size),
            "schedule/fill_efficiency": st.fill_efficiency,
            "schedule/imbalance": st.imbalance,
            "schedule/max_micro_batch_tokens": float(st.max_micro_batch_tokens),
            "schedule/dropped_rollouts": float(st.num_dropped_rollouts),
            "schedule/dropped_samples": float(st.num_dropped_samples),
            "schedule/leftover_rollouts": float(len(self.leftover_rollout_ids) if step == 0 else 0),
            "schedule/leftover_samples": float(self.num_leftover_samples if step == 0 else 0),
        }


def _check_positive_int(name: str, value: Any, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ScheduleError(f"{name} must be an integer >= 1, got {name}={value!r}")


def _validate_lengths(lengths: Any) -> np.ndarray:
    if isinstance(lengths, np.ndarray):
        if lengths.ndim != 1:
            raise ScheduleError(f"lengths must be 1-D, got shape {lengths.shape}")
        if lengths.size and lengths.dtype.kind not in "iu":
            raise ScheduleError(f"lengths[0] = {lengths[0].item()!r} is not an integer token count")
        arr = lengths.astype(np.int64)
    else:
        values = list(lengths)
        for i, x in enumerate(values):
            if isinstance(x, bool | np.bool_) or not isinstance(x, int | np.integer):
                shown = x.item() if isinstance(x, np.generic) else x
                raise ScheduleError(f"lengths[{i}] = {shown!r} is not an integer token count")
        arr = np.asarray(values, dtype=np.int64)
    if arr.size == 0:
        raise ScheduleError("lengths is empty: a schedule needs at least one sample")
    bad = np.flatnonzero(arr <= 0)
    if bad.size:
        i = int(bad[0])
        raise ScheduleError(
            f"lengths[{i}] = {int(arr[i])}: every sample needs a positive length (zero-length "
            "samples would make empty micro-batches); remove it upstream"
        )
    return arr


def _ids_list(ids: Any, name: str, n: int) -> list[Hashable]:
    out = ids.tolist() if isinstance(ids, np.ndarray) else list(ids)
    if len(out) != n:
        raise ScheduleError(f"len({name}) ({len(out)}) != len(lengths) ({n})")
    return out


def _group_rollouts(
    rollout_ids: list[Hashable] | None, group_ids: list[Hashable] | None, n: int
) -> tuple[list[Hashable], list[list[int]], list[int]]:
    """Rollouts in first-occurrence order (3.2): (ids, sample positions per rollout, group rank
    per rollout). With ``group_ids`` rollouts are stably reordered so groups are contiguous,
    groups in first-occurrence order."""
    if rollout_ids is None:
        keys: list[Hashable] = list(range(n))
        members = [[i] for i in range(n)]
    else:
        by_id: dict[Hashable, list[int]] = {}
        for pos, rid in enumerate(rollout_ids):
            by_id.setdefault(rid, []).append(pos)
        keys = list(by_id)
        members = list(by_id.values())
    if group_ids is None:
        return keys, members, list(range(len(keys)))
    group_rank: dict[Hashable, int] = {}
    for g in group_ids:
        group_rank.setdefault(g, len(group_rank))
    ranks = []
    for rid, pos in zip(keys, members, strict=True):
        groups = {group_ids[p] for p in pos}
        if len(groups) != 1:
            raise ScheduleError(
                f"rollout {rid!r} spans prompt groups {sorted(map(repr, groups))}: every rollout "
                "must lie in exactly one group"
            )
        ranks.append(group_rank[group_ids[pos[0]]])
    order = sorted(range(len(keys)), key=ranks.__getitem__)
    return [keys[i] for i in order], [members[i] for i in order], [ranks[i] for i in order]


def build_dp_schedule(
    lengths: Sequence[int] | np.ndarray,
    *,
    dp_size: int,
    max_tokens: int | None = None,
    micro_batch_size: int | None = None,
    rollout_ids: Sequence[Hashable] | np.ndarray | None = None,
    rollouts_per_step: int | None = None,
    micro_batch_group: int = 1,
    packing: str = "ffd",
    balance: str = "cost",
    group_ids: Sequence[Hashable] | np.ndarray | None = None,
    attn_coef: float = 1 / 12288,
) -> DPSchedule:
    """Schedule samples into per-rank micro-batches, step by step (slime PR #2065).

    Args:
      lengths: token count of sample i (prompt + response), all > 0.
      dp_size: data-parallel world size.
      max_tokens: token budget per micro-batch (dynamic mode). Exactly one of ``max_tokens`` and
        ``micro_batch_size`` must be given.
      micro_batch_size: samples per micro-batch (static mode: consecutive chunks, never split).
      rollout_ids: rollout id per sample (arbitrary hashables); ``None``: one rollout per sample.
        A rollout's samples are atomic for step membership and dropping.
      rollouts_per_step: rollouts per optimizer step; ``None``: one step with every rollout.
      micro_batch_group: per-rank micro-batch counts are multiples of it (slime's
        ``microbatch_group_size_per_vp_stage``; pass 1 to reproduce slime with vpp_size 1).
      packing: ``"ffd"`` (default, 5.1, with the first-fit fallback described in the module
        docstring) or ``"first_fit"`` (slime, 3.5). Ignored in static mode.
      balance: ``"cost"`` (5.2), ``"strided"`` (slime, 3.8) or ``"kk"`` (Karmarkar-Karp, 6).
      group_ids: optional prompt group per sample (5.6): groups are atomic for step membership,
        dropping and leftovers; a step boundary inside a group raises.
      attn_coef: cost of a sample of length l is ``l + attn_coef * l**2`` (balance and stats).

    Raises:
      ScheduleError: on any invalid input or unreachable alignment
        (docs/algorithms/schedule.md §4); no partial
        schedule is returned.
    """
    if (max_tokens is None) == (micro_batch_size is None):
        raise ScheduleError(
            "exactly one of max_tokens (dynamic, token budget) and micro_batch_size (static "
            f"chunks) must be given, got max_tokens={max_tokens!r}, "
            f"micro_batch_size={micro_batch_size!r}"
        )
    _check_positive_int("dp_size", dp_size)
    _check_positive_int("micro_batch_group", micro_batch_group)
    _check_positive_int("max_tokens", max_tokens, optional=True)
    _check_positive_int("micro_batch_size", micro_batch_size, optional=True)
    _check_positive_int("rollouts_per_step", rollouts_per_step, optional=True)
    if packing not in PACKINGS:
        raise ScheduleError(f"packing={packing!r} is not one of {PACKINGS}")
    if balance not in BALANCES:
        raise ScheduleError(f"balance={balance!r} is not one of {BALANCES}")
    if not (isinstance(attn_coef, int | float) and np.isfinite(attn_coef) and attn_coef >= 0):
        raise ScheduleError(f"attn_coef must be a finite number >= 0, got {attn_coef!r}")
    arr = _validate_lengths(lengths)
    n = int(arr.size)
    rids = None if rollout_ids is None else _ids_list(rollout_ids, "rollout_ids", n)
    gids = None if group_ids is None else _ids_list(group_ids, "group_ids", n)
    dp_size, micro_batch_group = int(dp_size), int(micro_batch_group)

    keys, members, group_rank = _group_rollouts(rids, gids, n)
    num_rollouts = len(keys)
    rps = num_rollouts if rollouts_per_step is None else int(rollouts_per_step)
    num_steps = num_rollouts // rps
    if num_steps < 1:
        raise ScheduleError(
            f"num_rollouts ({num_rollouts}) < global_batch_size ({rps}): rollouts_per_step={rps} "
            f"needs at least {rps} distinct rollouts; lower rollouts_per_step or add rollouts"
        )
    if gids is not None:
        for s in range(1, num_steps + 1):
            cut = s * rps
            if cut < num_rollouts and group_rank[cut - 1] == group_rank[cut]:
                g = gids[members[cut][0]]
                raise ScheduleError(
                    f"rollouts_per_step={rps} cuts prompt group {g!r} at the boundary after step "
                    f"{s - 1}: make rollouts_per_step a multiple of the group size"
                )

    costs = arr + float(attn_coef) * arr.astype(np.float64) ** 2
    steps: list[StepSchedule] = []
    for s in range(num_steps):
        lo, hi = s * rps, (s + 1) * rps
        sizes = [len(m) for m in members[lo:hi]]
        units = _drop_units(group_rank[lo:hi], sizes) if gids is not None else None
        samples = list(chain.from_iterable(members[lo:hi]))
        plan = plan_step(
            s,
            arr[samples],
            sizes if units is None else [u[1] for u in units],
            dp_size=dp_size,
            micro_batch_group=micro_batch_group,
            max_tokens=max_tokens,
            micro_batch_size=micro_batch_size,
            packing=packing,
            balance=balance,
            costs=costs[samples],
        )
        kept_rollouts = (
            plan.kept_units if units is None else sum(u[0] for u in units[: plan.kept_units])
        )
        step = _emit_step(
            plan,
            samples,
            keys[lo : lo + kept_rollouts],
            keys[lo + kept_rollouts : hi],
            max_tokens=max_tokens,
            micro_batch_size=micro_batch_size,
        )
        if step.dropped_rollout_ids:
            logger.warning(
                "[dp_schedule] step %d: dropped %d trailing rollout(s) (%d kept, %d samples) so "
                "the aligned micro-batch target stays reachable (dp_size=%d, align_to=%d).",
                s,
                len(step.dropped_rollout_ids),
                len(step.rollout_ids),
                step.stats.num_samples,
                dp_size,
                dp_size * micro_batch_group,
            )
        steps.append(step)

    leftover = keys[num_steps * rps :]
    num_leftover_samples = sum(len(m) for m in members[num_steps * rps :])
    if leftover:
        logger.warning(
            "[dp_schedule] %d leftover rollout(s) (%d samples) past the last whole step of "
            "%d rollouts were not scheduled: %s",
            len(leftover),
            num_leftover_samples,
            rps,
            leftover[:16],
        )
    return DPSchedule(
        steps=steps,
        dp_size=dp_size,
        max_tokens=None if max_tokens is None else int(max_tokens),
        micro_batch_size=None if micro_batch_size is None else int(micro_batch_size),
        micro_batch_group=micro_batch_group,
        rollouts_per_step=rps,
        packing=packing,
        balance=balance,
        num_samples=n,
        leftover_rollout_ids=leftover,
        num_leftover_samples=num_leftover_samples,
    )


def _drop_units(group_rank: list[int], rollout_sizes: list[int]) -> list[tuple[int, int]]:
    """The atomic units of a step for the drop loop, as (rollouts, samples): one per rollout, or
    one per prompt group when groups are given (consecutive rollouts of equal group rank)."""
    units: list[tuple[int, int]] = []
    prev = None
    for g, size in zip(group_rank, rollout_sizes, strict=True):
        if g == prev:
            r, smp = units[-1]
            units[-1] = (r + 1, smp + size)
        else:
            units.append((1, size))
        prev = g
    return units


def _emit_step(
    plan: StepPlan,
    samples: list[int],
    kept_ids: list[Hashable],
    dropped_ids: list[Hashable],
    *,
    max_tokens: int | None,
    micro_batch_size: int | None,
) -> StepSchedule:
    """Turn a plan (local bins and their ranks) into global micro-batches and stats."""
    bins = [[samples[i] for i in b] for b in plan.bins]
    micro_batches = [[bins[j] for j in rank_bins] for rank_bins in plan.rank_bins]
    tokens_per_rank = [int(plan.bin_tokens[rb].sum()) for rb in plan.rank_bins]
    cost_per_rank = [float(plan.bin_costs[rb].sum()) for rb in plan.rank_bins]
    num_bins = len(plan.bins)
    if max_tokens is not None:
        fill = int(plan.bin_tokens.sum()) / (num_bins * max_tokens)
    else:
        assert micro_batch_size is not None
        fill = plan.num_samples / (num_bins * micro_batch_size)
    mean_cost = sum(cost_per_rank) / len(cost_per_rank)
    stats = StepStats(
        num_micro_batches=num_bins // len(plan.rank_bins),
        num_samples=plan.num_samples,
        num_rollouts=len(kept_ids),
        num_dropped_rollouts=len(dropped_ids),
        num_dropped_samples=len(samples) - plan.num_samples,
        tokens_per_rank=tokens_per_rank,
        cost_per_rank=cost_per_rank,
        fill_efficiency=float(fill),
        imbalance=float(max(cost_per_rank) / mean_cost - 1.0),
        max_micro_batch_tokens=int(plan.bin_tokens.max()),
    )
    return StepSchedule(
        micro_batches=micro_batches,
        bins=bins,
        rank_bins=[list(rb) for rb in plan.rank_bins],
        sample_indices=samples[: plan.num_samples],
        rollout_ids=list(kept_ids),
        dropped_rollout_ids=list(dropped_ids),
        stats=stats,
    )
