"""The KV-cache geometry of a sampler call: batch buckets, decode slots, cache length, bytes.

Sampler programs are compiled per batch shape; padding a call's rows to a bucket lets calls of
nearby sizes share one program (``jaxrl.generate.sampler``). :func:`cache_geometry` is the one
place the sampler's cache shapes are derived: the sampler sizes its program with it, and the
memory planner (``jaxrl.train.run_io.memory``) counts the caches' bytes with it.
"""

from __future__ import annotations

import dataclasses

from jaxrl.data.batching.packing import BucketSpec, pick_bucket
from jaxrl.models.model_config import ModelConfig
from jaxrl.models.slot_kv_cache import DECODE_BLOCK, SlotKVCache


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
