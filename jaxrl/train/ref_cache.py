"""Reference log-prob cache for DPO (open-instruct PR #1447).

The reference sequence values ``ref_c[p], ref_r[p]`` of every training pair p are computed ONCE
from the initial (reference) parameters, with the training forward (``micro_batch_logprobs``),
the training packing (pairs scheduled as ``len_c + len_r`` samples into ``schedule.max_tokens``
rows, chosen then rejected) and the training aggregation (``sequence_logps``, sum or mean), and
stored keyed by row id p. Lookup gathers by row id, so it does not depend on shuffling,
epochs, micro-batching, packing or rank.

File: ``<reference_cache_dir>/<hash16>.npz`` holding fp32 ``chosen`` and ``rejected`` [N] and the
canonical JSON that was hashed (``identity``); ``hash16`` = the first 16 hex digits of SHA-256 of
that JSON (``CacheIdentity``). Writes go to a temporary file in the same directory, then
``os.replace`` onto the target, so a reader sees a whole file or none; temporaries (``.*.tmp``)
are never read. An existing file with the right hash is loaded, never rebuilt.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl.data.packing import pack_micro_batches, pick_bucket
from jaxrl.data.preference import PairDocuments, pair_micro_batches
from jaxrl.data.tokenizer import TextTokenizer
from jaxrl.losses.dpo import sequence_logps
from jaxrl.train.accumulate import DATA_AXIS
from jaxrl.train.forward import micro_batch_logprobs

BATCH_FIELDS = ("tokens", "targets", "loss_mask", "segment_ids", "positions")
ValuesFn = Callable[[Any, dict[str, jax.Array]], jax.Array]


class ReferenceCacheError(RuntimeError):
    """A cache is incomplete, mismatched or asked for a row it does not hold."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class CacheIdentity:
    """Everything that changes the cached values (spec §6); its canonical JSON is hashed."""

    model: str  # model path (or "init" for a fresh model)
    weights: str  # fingerprint of the reference parameters (``weight_fingerprint``)
    dataset: dict[str, Any]  # source, split and sizes (max_train_samples), seed
    data: str  # SHA-256 of the tokenised documents and masks (preprocessing, chat template)
    tokenizer: str  # SHA-256 of the vocabulary and special ids
    max_length: int  # per-document token limit applied at tokenisation
    packing: dict[str, Any]  # row budget (schedule.max_tokens) and bin packing
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
        arr = np.asarray(jax.device_get(leaf))
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
            h.update((Path(d) / name).read_bytes())
    return h.hexdigest()


class ReferenceCache:
    """fp32 reference values of N pairs, NaN until written; read back by row id."""

    def __init__(
        self,
        chosen: np.ndarray,
        rejected: np.ndarray,
        identity: CacheIdentity | None = None,
        *,
        path: Path | None = None,
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
    def save(self, directory: str | Path) -> Path:
        """Atomically write ``<directory>/<hash16>.npz`` (temp file + ``os.replace``)."""
        if self.identity is None:
            raise ReferenceCacheError("a cache without an identity cannot be saved")
        self.check_complete()
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        target = cache_path(directory, self.identity)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{self.identity.key}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(
                    f,
                    chosen=self.chosen,
                    rejected=self.rejected,
                    identity=np.asarray(self.identity.canonical_json()),
                )
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self.path = target
        return target

    @classmethod
    def load(cls, path: str | Path, identity: CacheIdentity) -> ReferenceCache:
        """Read a cache file and check it was written for ``identity`` and is complete."""
        path = Path(path)
        with np.load(path, allow_pickle=False) as f:
            stored = str(f["identity"])
            chosen, rejected = f["chosen"], f["rejected"]
        if stored != identity.canonical_json():
            raise ReferenceCacheError(
                f"{path} holds a cache for another configuration (stored identity {stored}); "
                "delete the file"
            )
        cache = cls(chosen, rejected, identity, path=path)
        cache.check_complete()
        return cache


def cache_path(directory: str | Path, identity: CacheIdentity) -> Path:
    """``<directory>/<hash16>.npz``."""
    return Path(directory) / f"{identity.key}.npz"


def load_or_build(
    directory: str | Path,
    identity: CacheIdentity,
    num_rows: int,
    fill: Callable[[ReferenceCache], None],
) -> ReferenceCache:
    """Load the cache for ``identity`` if its file exists; else ``fill`` an empty one, check it
    is complete, save it atomically and load it back (what training reads is what is on disk).

    Single process only (as the trainers today): spec §6's multi-process merge, where process 0
    writes and the others wait at a barrier, is not implemented.
    """
    if jax.process_count() > 1:
        raise NotImplementedError("the reference cache is built by a single process only")
    target = cache_path(directory, identity)
    if not target.is_file():
        built = ReferenceCache.empty(num_rows, identity)
        fill(built)
        built.save(directory)
    cache = ReferenceCache.load(target, identity)
    if cache.num_rows != num_rows:
        raise ReferenceCacheError(
            f"{cache.name}: {cache.num_rows} rows, but the dataset has {num_rows}; delete it"
        )
    return cache


# -- the forward shared by the cache and held-out evaluation --------------------------------


def document_logps(
    model: Any, mb: dict[str, jax.Array], *, mean: bool, chunk_size: int | None = None
) -> jax.Array:
    """Per-document sequence log-probs ``[B, S]`` of packed rows: the training forward
    (``micro_batch_logprobs``) and aggregation (``sequence_logps``: sum, or mean with the count
    clamped at 1) of ``dpo_loss_terms``."""
    logp_BT, _ = micro_batch_logprobs(model, mb, chunk_size=chunk_size)
    num_segments = mb["doc_sample_index"].shape[-1]
    return sequence_logps(logp_BT, mb["loss_mask"], mb["segment_ids"], num_segments, mean)


def fill_pair_logps(
    values_fn: ValuesFn,
    params: Any,
    docs: PairDocuments,
    sink: ReferenceCache,
    *,
    max_tokens: int,
    packing: str = "ffd",
    mesh: Mesh | None = None,
    rows_per_call: int = 32,
) -> None:
    """Write every pair's ``(chosen, rejected)`` sequence values into ``sink`` by row id.

    Pairs are packed as in training (``pair_micro_batches`` into ``max_tokens`` rows) and run
    through ``values_fn(params, mb) -> [B, S]`` in fixed chunks of ``rows_per_call`` rows (one
    compiled shape; the last chunk is padded with empty rows), sharded over ``mesh``'s data
    axis when given. No pair is dropped: every row id of ``docs`` is written exactly once.
    """
    layout = pair_micro_batches(
        range(docs.num_pairs), docs.pair_lengths, dp_size=1, max_tokens=max_tokens, packing=packing
    )
    most_docs = max(len(mb) for mb in layout[0])
    packed = pack_micro_batches(
        layout,
        docs.sequences,
        loss_masks=docs.masks,
        row_len=max_tokens,
        num_slots=len(layout[0]),
        num_segments=pick_bucket(most_docs + 1, None, "segment slots S"),
    )
    ranks = 1 if mesh is None else mesh.shape[DATA_AXIS]
    chunk = -(-rows_per_call // ranks) * ranks
    sharding = None if mesh is None else NamedSharding(mesh, P(DATA_AXIS))
    arrays = {name: getattr(packed, name)[0] for name in (*BATCH_FIELDS, "doc_sample_index")}
    num_rows = arrays["tokens"].shape[0]
    for lo in range(0, num_rows, chunk):
        part = {}
        for name, arr in arrays.items():
            block = arr[lo : lo + chunk]
            fill = -1 if name == "doc_sample_index" else 0
            pad = np.full((chunk - block.shape[0], *block.shape[1:]), fill, block.dtype)
            part[name] = np.concatenate([block, pad])
        batch = {k: jax.device_put(v, sharding) for k, v in part.items()}
        values_BS = np.asarray(values_fn(params, batch))
        index_BS = part["doc_sample_index"]
        docs_at = index_BS >= 0
        doc_ids, values = index_BS[docs_at], values_BS[docs_at]
        order = np.argsort(doc_ids, kind="stable")
        doc_ids, values = doc_ids[order], values[order]
        if not np.array_equal(doc_ids[0::2] + 1, doc_ids[1::2]) or np.any(doc_ids[0::2] % 2):
            raise RuntimeError("internal error: a pair's documents were split across chunks")
        sink.write(doc_ids[0::2] // 2, values[0::2], values[1::2])
