"""Reference log-prob cache for DPO (open-instruct PR #1447).

The reference sequence values ``ref_c[p], ref_r[p]`` of every training pair p are computed ONCE
from the initial (reference) parameters, with the training forward (``micro_batch_logprobs``,
run on every device by the no-grad ``Scorer``), the training packing (pairs scheduled as
``len_c + len_r`` samples into ``schedule.max_tokens`` rows, chosen then rejected) and the
training aggregation (``sequence_logps``, sum or mean), and stored keyed by row id p. Lookup
gathers by row id, so it does not depend on shuffling, epochs, micro-batching, packing or rank.

File: ``<reference_cache_dir>/<hash16>.npz`` holding fp32 ``chosen`` and ``rejected`` [N] and the
canonical JSON that was hashed (``identity``); ``hash16`` = the first 16 hex digits of SHA-256 of
that JSON (``CacheIdentity``). Writes go to a temporary file in the same directory, then
``os.replace`` onto the target, so a reader sees a whole file or none; temporaries (``.*.tmp``)
are never read. An existing file with the right hash is loaded, never rebuilt. With several
processes, all of them compute, process 0 writes, and all load after a barrier
(:func:`load_or_build`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import tempfile
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from etils import epath
from jax.experimental import multihost_utils

from jaxrl.data.batching.packing import PackedBatch, pack_micro_batches, pick_bucket
from jaxrl.data.batching.preference import PairDocuments, pair_micro_batches
from jaxrl.data.tokenizer import TextTokenizer
from jaxrl.runtime import storage
from jaxrl.runtime.mesh import barrier, is_primary, to_host
from jaxrl.train.score import DocumentScores, Scorer


class ReferenceCacheError(RuntimeError):
    """A cache is incomplete, mismatched or asked for a row it does not hold."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class CacheIdentity:
    """Everything that changes the cached values (docs/algorithms/dpo.md §6); its canonical JSON
    is hashed."""

    model: str  # model path (or "init" for a fresh model)
    weights: str  # fingerprint of the reference parameters (``weight_fingerprint``)
    dataset: dict[str, Any]  # source, split and sizes (max_train_samples), seed
    data: str  # SHA-256 of the tokenised documents and masks (preprocessing, chat template)
    tokenizer: str  # SHA-256 of the vocabulary and special ids
    max_length: int  # per-document token limit applied at tokenisation
    packing: dict[str, Any]  # row budget (schedule.max_tokens) and bin packing
    layout: dict[str, Any]  # how the rows are formed (e.g. the training steps' layout)
    loss_type: str  # canonical loss type, as open-instruct keys its cache
    aggregation: str  # "sum" or "mean" sequence log-probs (implied by the loss type)
    param_dtype: str
    dtype: str
    fp32_lm_head: bool
    logprob_chunk: int

    def canonical_json(self) -> str:
        """Sorted-key, whitespace-free JSON of every field."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":"))

    @property
    def key(self) -> str:
        """First 16 hex characters of SHA-256 over ``canonical_json()``."""
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()[:16]


def weight_fingerprint(params: Any, *, max_elements: int = 1 << 22) -> str:
    """SHA-256 over every parameter's path, shape, dtype and values.

    Leaves with more than ``max_elements`` values are hashed on an evenly strided sample of
    them (a fingerprint, not a proof: full hashing of a multi-GB model would dominate start-up).
    """
    h = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        arr = to_host(leaf)  # gathered from every process when sharded across them
        h.update(f"{jax.tree_util.keystr(path)}|{arr.shape}|{arr.dtype}".encode())
        flat = arr.reshape(-1)
        if flat.size > max_elements:
            flat = flat[:: -(-flat.size // max_elements)]
        h.update(np.ascontiguousarray(flat).tobytes())
    return h.hexdigest()


def tokenizer_fingerprint(tok: TextTokenizer) -> str:
    """SHA-256 of a tokenizer's saved files (vocabulary, model, special tokens)."""
    h = hashlib.sha256()
    with tempfile.TemporaryDirectory() as d:
        tok.save(d)
        for name in sorted(os.listdir(d)):
            h.update(name.encode())
            with open(os.path.join(d, name), "rb") as f:
                h.update(f.read())
    return h.hexdigest()


class ReferenceCache:
    """fp32 reference values of N pairs, NaN until written; read back by row id."""

    def __init__(
        self,
        chosen: np.ndarray,
        rejected: np.ndarray,
        identity: CacheIdentity | None = None,
        *,
        path: epath.Path | None = None,
    ):
        if chosen.shape != rejected.shape or chosen.ndim != 1:
            raise ValueError(f"chosen {chosen.shape} and rejected {rejected.shape} must be [N]")
        self.chosen = np.asarray(chosen, np.float32)
        self.rejected = np.asarray(rejected, np.float32)
        self.identity = identity
        self.path = path

    @classmethod
    def empty(cls, num_rows: int, identity: CacheIdentity | None = None) -> ReferenceCache:
        """A cache of ``num_rows`` rows, every value the NaN sentinel."""
        nan = np.full(num_rows, np.nan, np.float32)
        return cls(nan, nan.copy(), identity)

    @property
    def num_rows(self) -> int:
        return int(self.chosen.shape[0])

    @property
    def name(self) -> str:
        if self.path is not None:
            return str(self.path)
        return f"reference cache {self.identity.key}" if self.identity else "reference cache"

    def _check_ids(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, np.int64).reshape(-1)
        bad = ids[(ids < 0) | (ids >= self.num_rows)]
        if bad.size:
            raise ReferenceCacheError(
                f"{self.name}: row ids {bad[:8].tolist()} are outside [0, {self.num_rows}): the "
                "cache was built for another dataset; delete it or fix the row ids"
            )
        return ids

    def write(self, ids: Any, chosen: Any, rejected: Any) -> None:
        """Set rows ``ids``; writing a row twice is an error (each row is written once)."""
        ids = self._check_ids(ids)
        again = ids[~np.isnan(self.chosen[ids])]
        if again.size or len(set(ids.tolist())) != ids.size:
            raise ReferenceCacheError(f"{self.name}: rows written twice: {again[:8].tolist()}")
        self.chosen[ids] = np.asarray(chosen, np.float32)
        self.rejected[ids] = np.asarray(rejected, np.float32)

    def missing(self) -> np.ndarray:
        """Row ids still holding the NaN sentinel."""
        return np.flatnonzero(np.isnan(self.chosen) | np.isnan(self.rejected))

    def check_complete(self) -> None:
        """Error naming the cache, the missing count and the first missing row ids."""
        gone = self.missing()
        if gone.size:
            raise ReferenceCacheError(
                f"{self.name}: {gone.size} of {self.num_rows} rows are missing, first ids "
                f"{gone[:10].tolist()}; every row must reach a micro-batch"
            )

    def lookup(self, ids: Any) -> tuple[np.ndarray, np.ndarray]:
        """``(ref_chosen, ref_rejected)`` of rows ``ids``; an unwritten row is an error."""
        ids = self._check_ids(ids)
        c, r = self.chosen[ids], self.rejected[ids]
        gone = ids[np.isnan(c) | np.isnan(r)]
        if gone.size:
            raise ReferenceCacheError(
                f"{self.name}: {gone.size} requested rows are missing, first ids "
                f"{gone[:10].tolist()}"
            )
        return c, r

    def document_values(self) -> np.ndarray:
        """Per-document values for ``doc_fields``: document ``2p`` → chosen, ``2p+1`` → rejected."""
        self.check_complete()
        out = np.empty(2 * self.num_rows, np.float32)
        out[0::2], out[1::2] = self.chosen, self.rejected
        return out

    # -- files ------------------------------------------------------------------------------
    def save(self, directory: str | os.PathLike) -> epath.Path:
        """Atomically write ``<directory>/<hash16>.npz`` (temp file + ``os.replace``, or one
        upload to a URL: ``jaxrl.runtime.storage``)."""
        if self.identity is None:
            raise ReferenceCacheError("a cache without an identity cannot be saved")
        self.check_complete()
        target = cache_path(directory, self.identity)
        data = io.BytesIO()
        np.savez(
            data,
            chosen=self.chosen,
            rejected=self.rejected,
            identity=np.asarray(self.identity.canonical_json()),
        )
        storage.write_bytes(target, data.getvalue())
        self.path = target
        return target

    @classmethod
    def load(cls, path: str | os.PathLike, identity: CacheIdentity) -> ReferenceCache:
        """Read a cache file and check it was written for ``identity`` and is complete."""
        path = storage.path(path)
        with np.load(io.BytesIO(path.read_bytes()), allow_pickle=False) as f:
            stored = str(f["identity"])
            chosen, rejected = f["chosen"], f["rejected"]
        if stored != identity.canonical_json():
            raise ReferenceCacheError(
                f"{path} holds a cache for another configuration (stored identity {stored}); "
                "delete the file"
            )
        cache = cls(chosen, rejected, identity, path=path)
        cache.check_complete()
        values = np.concatenate([cache.chosen, cache.rejected])
        # a log-prob is <= 0, and a token's is > -200 in fp32 (softmax floor ~ -104)
        floor = -200.0 * max(identity.max_length, 1)
        bad = ~np.isfinite(values) | (values > 1e-3) | (values < floor)
        if bad.any():
            raise ReferenceCacheError(
                f"{path}: {int(bad.sum())} values are not log-probabilities (e.g. "
                f"{values[bad][:3].tolist()}; finite, <= 0 and >= {floor:g} expected): the file "
                "is damaged; delete it to rebuild"
            )
        return cache


def cache_path(directory: str | os.PathLike, identity: CacheIdentity) -> epath.Path:
    """``<directory>/<hash16>.npz`` (a local path or a URL)."""
    return storage.path(directory) / f"{identity.key}.npz"


def load_or_build(
    directory: str | os.PathLike,
    identity: CacheIdentity,
    num_rows: int,
    fill: Callable[[ReferenceCache], None],
) -> ReferenceCache:
    """Load the cache for ``identity`` if its file exists; else ``fill`` an empty one, check it
    is complete, save it atomically and load it back (what training reads is what is on disk).

    Several processes (``jax.distributed``): every process fills (the scoring is one collective
    program over the whole mesh, so all of them must run it), only process 0 writes the file,
    and all wait at a barrier before every process loads it. ``directory`` must therefore be
    storage every process sees. Whether to build is process 0's decision (broadcast), so the
    processes never disagree about running the collective fill.
    """
    target = cache_path(directory, identity)
    if not _primary_sees(target):
        built = ReferenceCache.empty(num_rows, identity)
        fill(built)
        if is_primary():
            built.save(directory)
        barrier(f"jaxrl reference cache {identity.key}")
        if not target.is_file():
            raise ReferenceCacheError(
                f"{target} is missing after process 0 wrote it (this is process "
                f"{jax.process_index()} of {jax.process_count()}): reference_cache_dir must be a "
                "directory every process sees (shared storage)"
            )
    cache = ReferenceCache.load(target, identity)
    if cache.num_rows != num_rows:
        raise ReferenceCacheError(
            f"{cache.name}: {cache.num_rows} rows, but the dataset has {num_rows}; delete it"
        )
    return cache


def _primary_sees(target: epath.Path) -> bool:
    """Whether process 0 finds ``target`` (the same answer on every process)."""
    exists = target.is_file()
    if jax.process_count() > 1:
        exists = bool(multihost_utils.broadcast_one_to_all(np.int32(exists)))
    return exists


# -- reference values through the scorer ----------------------------------------------------


def pack_pairs(docs: PairDocuments, *, max_tokens: int, packing: str = "ffd") -> PackedBatch:
    """Every pair of ``docs`` packed as in training: ``pair_micro_batches`` (``len_c + len_r``
    samples, chosen then rejected) into rows of ``max_tokens``, one rank."""
    layout = pair_micro_batches(
        range(docs.num_pairs), docs.pair_lengths, dp_size=1, max_tokens=max_tokens, packing=packing
    )
    most_docs = max(len(mb) for mb in layout[0])
    return pack_micro_batches(
        layout,
        docs.sequences,
        loss_masks=docs.masks,
        row_len=max_tokens,
        num_slots=len(layout[0]),
        num_segments=pick_bucket(most_docs + 1, None, "segment slots S"),
    )


def pair_scores(
    scorer: Scorer,
    params: Any,
    docs: PairDocuments,
    *,
    max_tokens: int,
    packing: str = "ffd",
    mean: bool = False,
) -> DocumentScores:
    """Per-document scores of every pair's documents (document ``2p`` chosen, ``2p + 1``
    rejected): the training packing (:func:`pack_pairs`), the training forward (the scorer's
    ``micro_batch_logprobs`` at temperature 1) and aggregation (``sequence_logps``: sum, or
    mean with the count clamped at 1, as ``dpo_loss_terms``), plus teacher-forced exact match."""
    packed = pack_pairs(docs, max_tokens=max_tokens, packing=packing)
    scores = scorer.documents(params, packed, mean=mean, temperature=1.0)
    if scores.logps.size != 2 * docs.num_pairs or np.isnan(scores.logps).any():
        raise RuntimeError("internal error: a pair's documents were not all scored")
    return scores


def fill_pair_logps(
    scorer: Scorer,
    params: Any,
    docs: PairDocuments,
    sink: ReferenceCache,
    *,
    max_tokens: int,
    packing: str = "ffd",
    mean: bool = False,
) -> None:
    """Write every pair's ``(chosen, rejected)`` sequence values (:func:`pair_scores`) into
    ``sink`` by row id. No pair is dropped: every row id of ``docs`` is written exactly once."""
    values = pair_scores(
        scorer, params, docs, max_tokens=max_tokens, packing=packing, mean=mean
    ).logps
    sink.write(np.arange(docs.num_pairs), values[0::2], values[1::2])
