"""The KV-cache geometry of a sampler call: batch buckets, decode slots, cache length, bytes.

Sampler programs are compiled per batch shape; padding a call's rows to a bucket lets calls of
nearby sizes share one program (``jaxrl.generate.sampler``). :func:`cache_geometry` is the one
place the sampler's cache shapes are derived: the sampler sizes its program with it, and the
memory planner (``jaxrl.train.run_io.memory``) counts the caches' bytes with it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxrl.data.batching.packing import BucketSpec, pick_bucket
from jaxrl.models.model_config import ModelConfig
from jaxrl.models.slot_kv_cache import DECODE_BLOCK, SlotKVCache

PACK_WIDTH = 512  # packed prompt rows are at most this wide, or P when P is wider
PACK_MIN_PROMPTS = 16  # fewer distinct prompts are prefilled one per row (prompt_rows)


def batch_bucket(b: int) -> int:
    """The batch size a call of ``b`` prompts is padded to: the smallest power of two or 1.5 times
    a power of two (1, 2, 3, 4, 6, 8, 12, 16, 24, ...) that holds it, so at most a third of the
    rows are empty and calls of nearby sizes share one compiled program. Empty rows never run,
    and every row's random bits depend on its index only, so the padding changes no
    completion."""
    size = 1
    while size < b:
        if size >= 2 and size * 3 // 2 >= b:
            return size * 3 // 2
        size *= 2
    return size


def decode_slots(num_requests: int, max_slots: int, ranks: int = 1) -> int:
    """Decode slots of a call of ``num_requests`` requests: ``max_slots`` (0 = one per request
    of the batch bucket), at most the bucket, rounded up to a multiple of ``ranks`` (the row
    ranks the slots are split over)."""
    padded = batch_bucket(num_requests)
    slots = min(max_slots or padded, padded)
    return -(-slots // ranks) * ranks


COMPACT_MIN = 8  # the engine's compacted loops run at least this many slots


def compact_sizes(slots: int, ranks: int = 1) -> tuple[int, ...]:
    """The smaller slot counts an engine program of ``slots`` decode slots moves its live slots
    into as requests stop (``engine.py``, "Compaction"): a half and a quarter of the slots,
    those of at least ``COMPACT_MIN``. None when the slots are split over several row ranks
    (gathering live slots would move them between devices)."""
    if ranks > 1:
        return ()
    return tuple(n for n in sorted({slots // 4, slots // 2}) if COMPACT_MIN <= n < slots)


def prompt_bucket(longest: int, prompt_buckets: BucketSpec = None, prefill_chunk: int = 0) -> int:
    """P: the length prompts of at most ``longest`` tokens are right-padded to (``prompt_buckets``
    as in ``pick_bucket``; None = :func:`batch_bucket`), a multiple of ``prefill_chunk``."""
    if prompt_buckets is None:  # 1, 2, 3, 4, 6, 8, ..., 32, 48, 64, 96, ...
        length = batch_bucket(longest)
    else:
        length = pick_bucket(longest, prompt_buckets, "prompt length P")
    if prefill_chunk and length > prefill_chunk:
        length = -(-length // prefill_chunk) * prefill_chunk
    return length


def cache_length(prompt_length: int, max_new_tokens: int, block: int = DECODE_BLOCK) -> int:
    """L: entries per decode slot for prompts padded to ``prompt_length`` (P + N, in blocks)."""
    return -(-(prompt_length + max_new_tokens) // block) * block


@dataclasses.dataclass(frozen=True)
class CacheGeometry:
    """The KV caches of one sampler call (docs/rollout.md)."""

    slots: int  # Sl decode slots, all ranks together (a multiple of the row ranks)
    cache_length: int  # L entries per slot
    prompt_length: int  # P: the prompt bucket
    groups: int  # Q distinct prompts, bucketed (the sampler pads them to a multiple of the ranks)

    def nbytes_per_device(self, config: ModelConfig, ranks: int, kv_split: int = 1) -> int:
        """Bytes on the largest device: the slots' cache ``[Nl, Sl, L, K, Dh]`` split over the
        ``ranks`` row ranks (and its K heads over ``kv_split`` tensor devices), plus the prompt
        groups' cache ``[Nl, Q, P, K, Dh]`` counted whole (keys and values, compute dtype)."""
        slots = SlotKVCache.nbytes(config, self.slots // ranks, self.cache_length, 1) // kv_split
        return slots + SlotKVCache.nbytes(config, self.groups, self.prompt_length, 1)


def cache_geometry(
    num_requests: int,
    num_groups: int,
    longest_prompt: int,
    *,
    max_new_tokens: int,
    max_slots: int = 0,
    ranks: int = 1,
    block: int = DECODE_BLOCK,
    prompt_buckets: BucketSpec = None,
    prefill_chunk: int = 0,
) -> CacheGeometry:
    """The caches of a call of ``num_requests`` requests over ``num_groups`` distinct prompts of
    at most ``longest_prompt`` tokens, for a sampler of these settings."""
    p = prompt_bucket(longest_prompt, prompt_buckets, prefill_chunk)
    return CacheGeometry(
        slots=decode_slots(num_requests, max_slots, ranks),
        cache_length=cache_length(p, max_new_tokens, block),
        prompt_length=p,
        groups=batch_bucket(num_groups),
    )


@dataclasses.dataclass(frozen=True)
class PromptRows:
    """Where a call's distinct prompts lie in the rows the engine prefills (``engine.py``)."""

    rows: int  # R rows (bucketed, a multiple of the row ranks)
    width: int  # W tokens per row
    row_Q: np.ndarray  # int32: the row prompt q lies in
    offset_Q: np.ndarray  # int32: the column its first token lies at

    @property
    def start_Q(self) -> np.ndarray:
        """Flat entry ``row * W + column`` of each prompt's first token."""
        return (self.row_Q * self.width + self.offset_Q).astype(np.int32)


def _first_fit(lengths: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray, int]:
    """First-fit decreasing of prompts into rows of ``width``: (row, offset, rows used)."""
    row_Q, offset_Q = np.zeros(len(lengths), np.int32), np.zeros(len(lengths), np.int32)
    free = np.full(len(lengths), width, np.int64)
    used = 0
    for q in np.argsort(-lengths, kind="stable"):
        j = int(np.argmax(free >= lengths[q]))
        row_Q[q], offset_Q[q] = j, width - free[j]
        free[j] -= lengths[q]
        used = max(used, j + 1)
    return row_Q, offset_Q, used


def prompt_rows(
    lengths: Sequence[int], prompt_length: int, *, ranks: int = 1, pack: bool = True
) -> PromptRows:
    """The rows a call's distinct prompts are prefilled in. ``pack=False``, or fewer than
    ``PACK_MIN_PROMPTS`` prompts: prompt q alone in row q, right-padded to ``prompt_length`` P
    (``batch_bucket(Q)`` rows; the shapes depend on Q's bucket and P only). ``pack=True``:
    several prompts per row (first-fit decreasing; a prompt attends to its own tokens only), in
    rows of W = P, 2P or 4P tokens (W <= max(P, PACK_WIDTH)), whichever prefills the fewest
    tokens with the row count bucketed (ties: the narrowest), so the prefill costs about the
    prompts' own tokens, not Q x P. The row count is then a batch bucket of at most Q's, and W
    one of three per P: a few programs per (Q bucket, P), not one per length mix."""
    lengths_Q = np.asarray(lengths, np.int64)
    q = len(lengths_Q)
    rows = lambda n: -(-batch_bucket(n) // ranks) * ranks  # noqa: E731
    if not pack or q < PACK_MIN_PROMPTS:
        ar = np.arange(q, dtype=np.int32)
        return PromptRows(rows(q), prompt_length, ar, np.zeros(q, np.int32))
    best = None
    for width in (prompt_length, 2 * prompt_length, 4 * prompt_length):
        if width > max(prompt_length, PACK_WIDTH):
            break
        row_Q, offset_Q, used = _first_fit(lengths_Q, width)
        cand = PromptRows(rows(used), width, row_Q, offset_Q)
        if best is None or cand.rows * cand.width < best.rows * best.width:
            best = cand
    return best
