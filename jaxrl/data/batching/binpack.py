"""Bin packing and bin balancing primitives of the DP schedule (pure Python / numpy, no jax).

These are the exact building blocks of slime's build_dp_schedule (PR #2065);
``jaxrl.data.batching.schedule`` composes them. Indices are positions into the ``lengths`` list a
function is given.

- ``first_fit``: online first-fit (3.5). A segment tree over the bins' remaining capacities
  finds the leftmost bin that fits in O(log B), which is exactly the bin the naive left-to-right
  scan finds, so ``first_fit`` equals slime's ``first_fit_pack`` bit for bit.
- ``first_fit_decreasing``: FFD (5.1), the same tree over ``(length desc, position asc)``.
- ``split_bin`` / ``expand_bins``: the alignment splitting rules (3.7).
- ``strided_ranks`` / ``cost_balanced_ranks`` (greedy, then ``swap_refine``) /
  ``karmarkar_karp``: distribution of bins over ranks (3.8, 5.2, 6).
- ``plan_step``: one step end to end on step-local indices: packing, the drop loop of slime
  PR #2065 (3.4), alignment by splitting (3.6) and distribution. ``jaxrl.data.batching.schedule``
  wraps it with rollout grouping, global indices and reporting.

Packing invariants: every index appears in exactly one bin; bins are non-empty and listed in
creation order; a bin's token sum is ``<= cap`` unless it holds a single sample longer than
``cap``. Balancing invariants: each rank gets exactly ``len(bins) / num_ranks`` whole bins, so
balancing never changes a bin and never breaks the cap.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np


class ScheduleError(ValueError):
    """The DP schedule cannot be built; the message names the cause and the fix.

    Public as ``jaxrl.data.batching.schedule.ScheduleError`` (defined here, the lowest module,
    so the step planner can raise it; tracebacks and pickles name the public path)."""

    __module__ = "jaxrl.data.batching.schedule"


def _first_fit_assign(lengths: list[int], cap: int) -> tuple[list[int], int]:
    """First-fit of ``lengths`` in list order; returns (bin id per item, number of bins).

    The leaves of a max segment tree hold each bin's remaining capacity. Leaves of bins not yet
    opened hold ``cap``, so "the leftmost leaf with room for ``l``" is the first existing bin that
    fits, or else the next new bin: the same choice as the naive scan, in O(log B).
    """
    n = len(lengths)
    normal = [x for x in lengths if x <= cap]
    n_over = n - len(normal)
    # Any-fit packings leave at most one bin at most half full, so the bin count is bounded by
    # n_over + 2 * sum / cap + 1; the tree needs one spare leaf beyond the last opened bin.
    bound = min(n, n_over + (2 * sum(normal)) // cap + 1) + 1
    size = 1
    while size < bound:
        size <<= 1
    # A leading run of items over half the cap (FFD's large items) opens one bin each: every
    # earlier bin holds one such item and has less than half the cap left. Set them up at once.
    head = 0
    while head < n and 2 * lengths[head] > cap:
        head += 1
    leaves = np.full(size, cap, dtype=np.int64)
    leaves[:head] = cap - np.asarray(lengths[:head], dtype=np.int64)
    levels = [leaves]
    while len(levels[-1]) > 1:
        levels.append(levels[-1].reshape(-1, 2).max(axis=1))
    tree = [0]  # tree[1] is the root, tree[size + j] is bin j's remaining capacity
    for level in reversed(levels):
        tree.extend(level.tolist())
    bin_of = list(range(head)) + [0] * (n - head)
    opened = head
    previous, i = -1, 0
    for k in range(head, n):
        length = lengths[k]
        if length == previous and tree[i] >= length:
            # Same length as the previous item, whose leaf i was the leftmost with room; the
            # bins left of i still lack room, so i is again the leftmost. (Long equal-length runs
            # are common once FFD reaches the short samples.)
            pass
        elif length > cap:  # oversized: nothing fits with it, it opens its own bin
            i = opened + size
            opened += 1
        else:
            i = 1
            while i < size:
                i <<= 1
                if tree[i] < length:
                    i += 1
            if i - size == opened:
                opened += 1
        previous = length
        value = tree[i] - length
        bin_of[k] = i - size
        tree[i] = value
        node = i
        while node > 1:  # propagate the new maximum upwards; stop once an ancestor is unchanged
            sibling = tree[node ^ 1]
            if sibling > value:
                value = sibling
            node >>= 1
            if tree[node] == value:
                break
            tree[node] = value
    return bin_of, opened


def bins_from_assignment(bin_of: np.ndarray, num_bins: int) -> list[list[int]]:
    """Group positions by bin id: bins in id order, positions ascending inside each bin."""
    bin_of = np.asarray(bin_of, dtype=np.int64)
    order = np.argsort(bin_of, kind="stable").tolist()
    ends = np.cumsum(np.bincount(bin_of, minlength=num_bins)).tolist()
    return [order[start:end] for start, end in zip([0, *ends[:-1]], ends, strict=True)]


def first_fit_assignment(lengths: Sequence[int], cap: int) -> tuple[np.ndarray, int]:
    """First-fit bin id of every position, and the number of bins (arrival order, 3.5)."""
    bin_of, num_bins = _first_fit_assign([int(x) for x in lengths], int(cap))
    return np.asarray(bin_of, dtype=np.int64), num_bins


def first_fit(lengths: Sequence[int], cap: int) -> list[list[int]]:
    """slime's ``first_fit_pack``: each item goes into the first bin with ``sum + len <= cap``.

    Bins are in creation order and keep arrival order inside. Example: lengths
    ``[6,5,4,3,2,1]``, cap 10 -> ``[[0,2],[1,3,4],[5]]``. First-fit is prefix stable: packing a
    prefix equals packing the whole list restricted to that prefix.
    """
    bin_of, num_bins = first_fit_assignment(lengths, cap)
    return bins_from_assignment(bin_of, num_bins)


def first_fit_decreasing_assignment(lengths: Sequence[int], cap: int) -> tuple[np.ndarray, int]:
    """FFD bin id of every position (5.1): first-fit over ``(length desc, position asc)``."""
    arr = np.asarray(lengths, dtype=np.int64)
    order = np.argsort(-arr, kind="stable")
    sorted_bins, num_bins = _first_fit_assign(arr[order].tolist(), int(cap))
    bin_of = np.empty(len(arr), dtype=np.int64)
    bin_of[order] = sorted_bins
    return bin_of, num_bins


def first_fit_decreasing(lengths: Sequence[int], cap: int) -> list[list[int]]:
    """FFD: bins in creation order, samples inside a bin by ascending position.

    Example: ``[3,3,3,7,7,7]`` with cap 10 -> ``[[0,3],[1,4],[2,5]]`` (first-fit makes 4 bins).
    """
    bin_of, num_bins = first_fit_decreasing_assignment(lengths, cap)
    return bins_from_assignment(bin_of, num_bins)


def split_bin(bin_: Sequence[int], lengths: Sequence[int]) -> tuple[list[int], list[int]]:
    """Split one bin in two (3.7): stable sort by length descending, then each index goes to half
    0 if ``sum0 <= sum1`` else to half 1. Halves keep fill order; both sums are <= the bin's.

    Example: ``[0,1,2]`` with lengths ``[1,2,3]`` -> ``([2], [1,0])``.
    """
    halves: tuple[list[int], list[int]] = ([], [])
    sums = [0, 0]
    for index in sorted(bin_, key=lengths.__getitem__, reverse=True):  # stable descending
        half = 0 if sums[0] <= sums[1] else 1
        halves[half].append(index)
        sums[half] += lengths[index]
    return halves


def expand_bins(
    bins: list[list[int]],
    target: int,
    lengths: Sequence[int],
    sums: Sequence[int] | None = None,
) -> None:
    """Split bins in place until ``len(bins) == target`` or every bin is a singleton (3.7).

    Each round splits the bin with two or more items and the maximum ``(token_sum, position)``
    (sum ties go to the later bin); half 0 replaces it in place, half 1 is appended. A heap keyed
    on ``(-sum, -position)`` finds it in O(log B); a bin's entry is only invalidated by its own
    split, so the heap never holds stale entries. ``sums``: the bins' token sums, if known.
    """
    if sums is None:
        sums = [sum(lengths[i] for i in b) for b in bins]
    heap = [(-int(sums[j]), -j) for j, b in enumerate(bins) if len(b) > 1]
    heapq.heapify(heap)
    while len(bins) < target and heap:
        _, neg_pos = heapq.heappop(heap)
        j = -neg_pos
        half0, half1 = split_bin(bins[j], lengths)
        bins[j] = half0
        bins.append(half1)
        for pos, half in ((j, half0), (len(bins) - 1, half1)):
            if len(half) > 1:
                heapq.heappush(heap, (-sum(lengths[i] for i in half), -pos))


def strided_ranks(num_bins: int, num_ranks: int) -> list[list[int]]:
    """slime's distribution (3.8): bin j goes to rank ``j % num_ranks``."""
    return [list(range(r, num_bins, num_ranks)) for r in range(num_ranks)]


def cost_balanced_ranks(costs: Sequence[float], num_ranks: int) -> list[list[int]]:
    """Cost balance with equal bin counts (5.2): greedy, then swaps.

    Greedy: bins by ``(cost desc, index asc)``; each goes to the rank with the least total cost
    among ranks holding fewer than ``n = len(costs) / num_ranks`` bins (ties: lowest rank).
    The count limit can force the last, smallest bins onto ranks that are already heavy, so
    ``swap_refine`` then trades bins between the heaviest rank and the others. A rank's bins are
    returned by ascending index.
    """
    per_rank = len(costs) // num_ranks
    ranks: list[list[int]] = [[] for _ in range(num_ranks)]
    heap = [(0.0, r) for r in range(num_ranks)]
    order = np.lexsort((np.arange(len(costs)), -np.asarray(costs, dtype=np.float64)))
    for j in order.tolist():  # cost descending, index ascending
        total, r = heapq.heappop(heap)
        ranks[r].append(j)
        if len(ranks[r]) < per_rank:
            heapq.heappush(heap, (total + costs[j], r))
    swap_refine(costs, ranks)
    for bins_r in ranks:
        bins_r.sort()
    return ranks


def swap_refine(costs: Sequence[float], ranks: list[list[int]]) -> None:
    """Lower the heaviest rank's cost by swapping bins, in place; bin counts stay as they are.

    Each round takes the heaviest rank ``h`` (ties: lowest rank) and, over every other rank
    ``r`` and every pair of a bin ``a`` of ``h`` and ``b`` of ``r`` with
    ``0 < cost[a] - cost[b] < total[h] - total[r]``, the swap that leaves the pair's heavier
    total smallest (ties: lowest ``r``, then ``a``, then ``b``). A swap strictly lowers that
    pair's larger total and never raises the maximum over ranks; rounds stop when no swap helps
    the heaviest rank, after at most ``len(costs)`` swaps.

    Cost (docs/algorithms/schedule.md §5.2). Each rank's bins are a row of a matrix, sorted by
    ``(cost, bin)``. For a bin ``b`` of rank ``r`` the best partner in ``h`` is one of the two
    bins of ``h`` whose costs bracket ``cost[b] + gap / 2`` (the pair's heavier total is V-shaped
    in ``cost[a]``), so one ``searchsorted`` of every bin of a set of ranks into ``h``'s sorted
    row finds every rank's best swaps at once. No swap with ``r`` can leave less than
    ``(total[h] + total[r]) / 2``, so ranks are visited lightest first in chunks of 8, 64, 512,
    ... and the visit stops at the first rank whose bound exceeds the best swap found. A round
    then costs O(log k) Python steps plus numpy over the few rows visited, instead of a sort of
    every rank: 100,000 samples on 1,024 ranks take well under a second (it was 27 s). The
    result is the same swap, round by round, as the brute-force rule above
    (tests/test_schedule_properties.py checks it against such a reference).
    """
    k = len(ranks)
    width = max((len(r) for r in ranks), default=0)
    if k < 2 or width == 0:
        return
    cost = np.asarray(costs, dtype=np.float64)
    # Row r: rank r's bin costs ascending (ties by bin id), between a -inf and +inf column so
    # both neighbours of any search position exist; padding pairs with nothing (d = +-inf or nan).
    row_cost = np.full((k, width + 2), np.inf)
    row_cost[:, 0] = -np.inf
    row_bin = np.full((k, width + 2), len(cost), dtype=np.int64)
    totals = np.empty(k)
    for r, bins_r in enumerate(ranks):
        totals[r] = sum(float(cost[j]) for j in bins_r)  # the order the spec sums in
        _sorted_row(row_cost, row_bin, r, bins_r, cost)
    by_total = sorted(zip(totals.tolist(), range(k), strict=True))  # (total, rank) ascending
    with np.errstate(invalid="ignore"):
        for _ in range(len(cost)):
            top = by_total[-1][0]
            lighter = bisect.bisect_left(by_total, (top, -1))  # ranks strictly lighter than h
            h = by_total[lighter][1]
            best: tuple[float, int, int, int] | None = None
            start, size, end = 0, 8, lighter
            while start < end:
                rows = np.array([r for _, r in by_total[start : min(start + size, end)]])
                found = _best_swap(row_cost, row_bin, totals, h, rows)
                if found is not None and (best is None or found < best):
                    best = found
                    # only ranks with (top + total) / 2 <= best can still tie or beat it
                    reach = 2 * best[0] - top + 1e-9 * abs(top)
                    end = min(end, bisect.bisect_right(by_total, (reach, k)))
                start, size = start + size, size * 8
            if best is None or best[0] >= top:
                return
            _, r, a, b = best
            ranks[h][ranks[h].index(a)] = b
            ranks[r][ranks[r].index(b)] = a
            d = cost[a] - cost[b]
            for rank, total in ((h, totals[h] - d), (r, totals[r] + d)):
                del by_total[bisect.bisect_left(by_total, (totals[rank], rank))]
                bisect.insort(by_total, (float(total), rank))
                totals[rank] = total
                _sorted_row(row_cost, row_bin, rank, ranks[rank], cost)


def _sorted_row(
    row_cost: np.ndarray, row_bin: np.ndarray, r: int, bins_r: list[int], cost: np.ndarray
) -> None:
    """Write rank ``r``'s bins into its row, by ``(cost, bin)`` ascending, after the -inf column."""
    ids = np.asarray(bins_r, dtype=np.int64)
    values = cost[ids]
    order = np.lexsort((ids, values))
    row_cost[r, 1 : len(ids) + 1] = values[order]
    row_bin[r, 1 : len(ids) + 1] = ids[order]


_BRACKET = np.array([1, 0]).reshape(2, 1, 1)


def _best_swap(
    row_cost: np.ndarray, row_bin: np.ndarray, totals: np.ndarray, h: int, rows: np.ndarray
) -> tuple[float, int, int, int] | None:
    """The smallest ``(new heavier total, r, a, b)`` over swaps of a bin ``a`` of ``h`` with a
    bin ``b`` of a rank ``r`` in ``rows``, or None when no pair of them qualifies."""
    top = totals[h]
    mine = row_cost[h]
    theirs = row_cost[rows]
    low = totals[rows][:, None]
    gap = top - low
    above = mine.searchsorted(theirs + gap / 2)
    partner = mine[above - _BRACKET]  # the two costs bracketing the level point
    d = partner - theirs
    new_max = np.where((d > 0) & (d < gap), np.maximum(top - d, low + d), np.inf)
    value = new_max.min()
    if value == np.inf:
        return None
    _, i, j = np.nonzero(new_max == value)
    # a: the lowest bin id among h's bins of that cost (rows are sorted by (cost, bin))
    a = row_bin[h][np.searchsorted(mine, partner[new_max == value], side="left")]
    return min(
        zip(
            [float(value)] * len(i),
            rows[i].tolist(),
            a.tolist(),
            row_bin[rows[i], j].tolist(),
            strict=True,
        )
    )


class _KKState:
    """A partial k-way partition: ``sets`` sorted heaviest first, each ``[sum, items]``."""

    __slots__ = ("sets",)

    def __init__(self, items: list[tuple[int, float]], k: int) -> None:
        sets = [[0.0, []] for _ in range(k)]
        for s, (idx, w) in zip(sets, items, strict=False):
            s[0] += w
            s[1].append((idx, w))
        self.sets = sorted(sets, key=_set_key, reverse=True)

    @property
    def spread(self) -> float:
        return self.sets[0][0] - self.sets[-1][0]

    def merge(self, other: _KKState) -> None:
        k = len(self.sets)
        for i in range(k):
            theirs = other.sets[k - 1 - i]
            self.sets[i][0] += theirs[0]
            self.sets[i][1].extend(theirs[1])
        self.sets.sort(key=_set_key, reverse=True)

    def __lt__(self, other: _KKState) -> bool:
        # Pop the largest spread first; on equal spread, the state with the heavier top set.
        if self.spread != other.spread:
            return self.spread > other.spread
        return _set_key(self.sets[0]) > _set_key(other.sets[0])


def _set_key(s: list) -> tuple:
    return (s[0], len(s[1]), s[1])


def karmarkar_karp(weights: Sequence[float], k: int, *, equal_size: bool) -> list[list[int]]:
    """Largest-differencing (Karmarkar-Karp) k-way partition of ``weights``
    (docs/algorithms/schedule.md §6).

    Returns ``k`` sets of indices, heaviest set first, each sorted ascending. With
    ``equal_size`` every set has ``len(weights) / k`` items (requires divisibility). Example:
    ``[1,2,3,4,5,7,9,10]``, k=2, equal -> ``[[1,3,4,7],[0,2,5,6]]``; k=3, unequal ->
    ``[[0,3,6],[1,4,5],[2,7]]``. No optimality is promised.
    """
    n = len(weights)
    if n < k:
        raise ValueError(f"karmarkar_karp: {n} items < {k} sets: every set must be non-empty")
    if equal_size and n % k:
        raise ValueError(f"karmarkar_karp: {n} items not divisible into {k} equal-size sets")
    ordered = sorted((w, i) for i, w in enumerate(weights))
    states: list[_KKState] = []
    chunk = k if equal_size else 1
    for o in range(0, n, chunk):
        heapq.heappush(states, _KKState([(i, w) for w, i in ordered[o : o + chunk]], k))
    while len(states) > 1:
        first = heapq.heappop(states)
        second = heapq.heappop(states)
        first.merge(second)
        heapq.heappush(states, first)
    partitions = [sorted(i for i, _ in s[1]) for s in states[0].sets]
    if any(not p for p in partitions):
        raise ValueError("karmarkar_karp: produced an empty set")
    return partitions


# ------------------------------------------------------------------------------------------------
# One step: packing, drop loop, alignment, distribution
# (docs/algorithms/schedule.md §3.3-3.8, §5.1-5.3).


def aligned_target(num_bins: int, align_to: int) -> int:
    """``max(ceil(K / align_to) * align_to, align_to)`` (3.6)."""
    return max(-(-num_bins // align_to) * align_to, align_to)


@dataclass(frozen=True)
class StepPlan:
    """A planned step on step-local indices. The kept samples are ``range(num_samples)`` (a
    prefix of whole units); ``bins`` has an aligned count; rank r runs ``rank_bins[r]`` in order."""

    bins: list[list[int]]
    rank_bins: list[list[int]]
    bin_tokens: np.ndarray  # int64 [len(bins)]
    bin_costs: np.ndarray  # float64 [len(bins)]
    kept_units: int
    num_samples: int


class _StepPacker:
    """Packs prefixes of one step's samples; the drop loop asks it about several prefixes.

    First-fit is prefix stable, so it runs once on the whole step and any prefix is read off by
    restriction (bins are created in order, so a prefix of p samples has ``cummax[p-1] + 1``
    bins). FFD is re-packed per prefix; a cheap lower bound on any packing's bin count answers
    most drop-loop questions without packing at all.
    """

    def __init__(self, lengths: np.ndarray, cap: int, packing: str, align_to: int) -> None:
        self.lengths, self.cap, self.packing, self.align_to = lengths, cap, packing, align_to
        self._ff: tuple[np.ndarray, np.ndarray] | None = None
        over = lengths > cap
        self._over = np.cumsum(over)
        self._half = np.cumsum((2 * lengths > cap) & ~over)
        self._normal = np.cumsum(np.where(over, 0, lengths))

    def _first_fit(self) -> tuple[np.ndarray, np.ndarray]:
        if self._ff is None:
            bin_of, _ = first_fit_assignment(self.lengths, self.cap)
            self._ff = (bin_of, np.maximum.accumulate(bin_of))
        return self._ff

    def _ff_count(self, p: int) -> int:
        return int(self._first_fit()[1][p - 1]) + 1

    def _ff_bins(self, p: int) -> list[list[int]]:
        return bins_from_assignment(self._first_fit()[0][:p], self._ff_count(p))

    def _lower_bound(self, p: int) -> int:
        """Bins any packing needs: oversized samples alone, the rest by volume and halves."""
        volume = -(-int(self._normal[p - 1]) // self.cap)
        return int(self._over[p - 1]) + max(volume, int(self._half[p - 1]))

    def bins(self, p: int) -> list[list[int]]:
        """Bins of the first ``p`` samples. ``ffd``: FFD unless first-fit reaches a strictly
        smaller aligned target (so default mode is never behind slime mode)."""
        if self.packing == "first_fit":
            return self._ff_bins(p)
        bin_of, k = first_fit_decreasing_assignment(self.lengths[:p], self.cap)
        target = aligned_target(k, self.align_to)
        if target > aligned_target(self._lower_bound(p), self.align_to):
            if aligned_target(self._ff_count(p), self.align_to) < target:
                return self._ff_bins(p)
        return bins_from_assignment(bin_of, k)

    def overflows(self, p: int) -> tuple[bool, list[list[int]] | None]:
        """Drop-loop condition (a): is the aligned target of ``p`` samples' bins more than ``p``?
        Also returns the bins when they had to be packed to answer."""
        if self.packing == "first_fit":
            return aligned_target(self._ff_count(p), self.align_to) > p, None
        if aligned_target(self._lower_bound(p), self.align_to) > p:
            return True, None
        bins = self.bins(p)
        return aligned_target(len(bins), self.align_to) > p, bins


def _bin_sums(values: np.ndarray, bins: list[list[int]]) -> np.ndarray:
    flat = np.fromiter(chain.from_iterable(bins), dtype=np.int64)
    starts = np.cumsum([0] + [len(b) for b in bins[:-1]])
    return np.add.reduceat(values[flat], starts)


def plan_step(
    step: int,
    lengths: np.ndarray,
    unit_sizes: Sequence[int],
    *,
    dp_size: int,
    micro_batch_group: int,
    max_tokens: int | None,
    micro_batch_size: int | None,
    packing: str,
    balance: str,
    costs: np.ndarray,
) -> StepPlan:
    """Plan step ``step`` whose samples (step order) have ``lengths`` and ``costs``.

    ``unit_sizes`` are the sample counts of the step's atomic units (rollouts, or prompt groups)
    in order; the drop loop removes whole trailing units. Raises ``ScheduleError`` (3.3, 3.6, 5.3).
    """
    n = len(lengths)
    align_to = dp_size * micro_batch_group
    if n < dp_size:
        raise ScheduleError(
            f"step {step}: {n} samples < dp_size {dp_size}; each step needs at least one sample "
            "per rank: raise rollouts_per_step or lower dp_size"
        )
    if n < align_to:
        raise ScheduleError(
            f"step {step}: {n} samples < dp_size * micro_batch_group = {align_to} "
            f"(dp_size={dp_size}, micro_batch_group={micro_batch_group}): cannot align "
            "micro-batches, every rank needs micro_batch_group micro-batches; raise "
            "rollouts_per_step or lower micro_batch_group"
        )
    kept_units = len(unit_sizes)
    if max_tokens is None:
        assert micro_batch_size is not None
        bins = [list(range(i, min(i + micro_batch_size, n))) for i in range(0, n, micro_batch_size)]
        if len(bins) % align_to:
            raise ScheduleError(
                f"step {step}: static path: num_mbs ({len(bins)}) is not a multiple of dp_size * "
                f"mb_group ({align_to}): cannot align micro-batches. {n} samples in chunks of "
                f"micro_batch_size={micro_batch_size} (dp_size={dp_size}, micro_batch_group="
                f"{micro_batch_group}); static chunks are never split, so choose rollouts_per_step"
                f" and micro_batch_size with ceil(samples / micro_batch_size) % {align_to} == 0"
            )
        kept = n
    else:
        packer = _StepPacker(lengths, max_tokens, packing, align_to)
        ends = np.cumsum(unit_sizes).tolist()
        maybe_bins: list[list[int]] | None = None
        if align_to > 1:  # drop loop of slime PR #2065 (3.4)
            while True:
                kept = ends[kept_units - 1]
                overflow, maybe_bins = packer.overflows(kept)
                if not overflow or kept - unit_sizes[kept_units - 1] < align_to:
                    break
                kept_units -= 1
        kept = ends[kept_units - 1]
        bins = maybe_bins if maybe_bins is not None else packer.bins(kept)
        target = aligned_target(len(bins), align_to)
        if target != len(bins):
            expand_bins(bins, target, lengths.tolist(), _bin_sums(lengths, bins).tolist())
            if len(bins) < target:
                raise ScheduleError(
                    f"step {step}: cannot align micro-batches to a multiple of align_to="
                    f"{align_to} (dp_size={dp_size}): after dropping {len(unit_sizes) - kept_units}"
                    f" trailing rollout(s) the step keeps {kept} samples, which split into at most"
                    f" {len(bins)} micro-batches, but the aligned target is {target}. Retune "
                    "rollouts_per_step, num_generations or max_tokens so each step's kept sample "
                    "count can reach a multiple of align_to"
                )
    bin_tokens = _bin_sums(lengths, bins)
    bin_costs = _bin_sums(costs, bins)
    if balance == "strided":
        rank_bins = strided_ranks(len(bins), dp_size)
    elif balance == "cost":
        rank_bins = cost_balanced_ranks(bin_costs.tolist(), dp_size)
    else:
        try:
            rank_bins = karmarkar_karp(bin_costs.tolist(), dp_size, equal_size=True)
        except ValueError as e:
            raise ScheduleError(f"step {step}: balance='kk' precondition violated: {e}") from e
    return StepPlan(bins, rank_bins, bin_tokens, bin_costs, kept_units, kept)
