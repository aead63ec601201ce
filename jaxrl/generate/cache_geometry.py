"""Batch sizes a sampler call is padded to, and the decode slots it runs with.

Sampler programs are compiled per batch shape; padding a call's B rows to a bucket lets calls of
nearby sizes share one program (``jaxrl.generate.sampler``). The memory planner
(``jaxrl.train.run_io.memory``) sizes the sampler's KV cache with the same rule.
"""

from __future__ import annotations


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
