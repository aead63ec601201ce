"""No-grad scoring of packed rows on every device: the one program behind every non-train forward.

:class:`Scorer` runs the trainer's forward (``micro_batch_scores``: the hidden states, head and
chunking of ``micro_batch_logprobs``) over packed rows ``[N, T]`` and returns, per token, fp32
``logp`` and ``entropy`` at a temperature and ``correct`` (the argmax of the model's logits is
the target: teacher-forced exact match, independent of the temperature), as host numpy. Its
consumers:

- GRPO old / reference token log-probs (:meth:`Scorer.token_logprobs`) and the step's entropy
  threshold τ_H (:meth:`Scorer.step_entropy_threshold`);
- the DPO reference cache and held-out evaluation, and SFT held-out exact match, through
  per-document values (:meth:`Scorer.documents`: ``sequence_logps`` sums or means, exact match).

Layout. The rows are cut into calls of a fixed ``rows_per_call`` C (a multiple of the mesh's
row ranks R = data × fsdp; the last call is padded with empty rows), split over the batch axes,
so every device holds C / R rows. The program has the train step's structure
(``jaxrl.train.accumulate``): ``shard_map`` manual over the batch axes (``tensor`` stays
automatic), parameters replicated over them unless they are split over ``fsdp``, and ``lax.map``
over the rank's rows, one ``[1, T]`` row at a time, the shape of a micro-batch. With
``fsdp > 1`` the parameters enter as their fsdp shards and the model gathers each weight where
it uses it, one scanned layer at a time (ZeRO-3, ``jaxrl.models.fsdp``), as in the train step.
Values therefore equal the train step's forward bit
for bit, in bf16 compute too (a GSPMD-partitioned program rounds differently): a DPO reference
equals the policy at step 1, and a GRPO ratio against scored old log-probs starts at exactly
1. The temperature is a traced argument: one compiled program per
``(C, T)`` bucket (``Scorer.compiles`` counts them). Rows without any token (segment 0 only, as
bucket padding slots) are not run; their values are 0 (``correct`` False).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import flax.nnx as nnx
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl.data.batching.packing import PackedBatch, pack_sequences
from jaxrl.data.batching.shared_prompt import (
    PARENT_FIELD,
    pack_shared_sequences,
    split_shared_by_sample,
)
from jaxrl.losses.dpo import sequence_logps
from jaxrl.losses.policy import entropy_threshold
from jaxrl.runtime.mesh import to_host
from jaxrl.runtime.spmd import manual_batch_axes, on_mesh, put_replicated, put_rows, row_ranks
from jaxrl.train.forward import micro_batch_scores
from jaxrl.train.per_rank import as_shards, fsdp_in_specs, marked, per_rank_map

ROW_FIELDS = ("tokens", "targets", "segment_ids", "positions")
MASK_FIELD = "loss_mask"  # optional: values only where it is non-zero (the rest 0 / False)
FORWARD_FIELD_PREFIX = "moe_"  # float token fields the forward reads (router replay)

_sequence_values = jax.jit(sequence_logps, static_argnums=(3, 4))
_entropy_threshold = jax.jit(entropy_threshold, static_argnums=2)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowScores:
    """Per-token results of :meth:`Scorer.score`, laid out like the rows' ``tokens`` (also the
    compiled program's output, one ``[T]`` row per packed row, before it reaches the host)."""

    logp: np.ndarray  # float32 [..., T]: log p(targets[t] | tokens[<= t]) at the temperature
    entropy: np.ndarray  # float32 [..., T]: entropy of that distribution
    correct: np.ndarray  # bool [..., T]: argmax of the logits == targets[t]


@dataclasses.dataclass(frozen=True)
class DocumentScores:
    """Per-document results of :meth:`Scorer.documents`, indexed by sample index (the values of
    ``doc_sample_index``); documents absent from the batch hold NaN / False."""

    logps: np.ndarray  # float32 [D]: sum (or mean) of the loss tokens' log-probs
    correct: np.ndarray  # bool [D]: every loss token's argmax is its target
    scored: np.ndarray  # bool [D]: the document has at least one loss token

    def exact_match(self, ids: Any = None) -> float:
        """Fraction of the scored documents among ``ids`` (default all) that are correct:
        teacher-forced exact match, equal to greedy-decoding exact match."""
        sel = slice(None) if ids is None else np.asarray(ids, np.int64)
        scored, correct = self.scored[sel], self.correct[sel]
        return float(np.sum(correct & scored)) / max(float(np.sum(scored)), 1.0)


class Scorer:
    """Per-token log-probs, entropies and argmax hits of packed rows under given parameters.

    ``mesh``: rows are split over its batch axes (None: wherever ``jit`` puts them with the
    parameters). ``chunk_size``: the head's token chunk (``model.logprob_chunk``; 0 =
    automatic, ``jaxrl.models.head.auto_chunk``). ``rows_per_call``: rows per compiled call,
    rounded up to a multiple of the row ranks.
    ``row_len`` and ``temperature``: defaults of :meth:`token_logprobs` and
    :meth:`step_entropy_threshold` (GRPO scores at its sampling temperature).
    """

    def __init__(
        self,
        graphdef: Any,
        *,
        mesh: Mesh | None = None,
        chunk_size: int = 0,
        rows_per_call: int = 32,
        row_len: int | None = None,
        temperature: float = 1.0,
        row_scores: Any = micro_batch_scores,
    ):
        """``row_scores(model, mb, chunk_size=, temperature=)``: the per-row forward,
        ``(logp, entropy, correct)`` each ``[1, T]`` (another model's values in the ``logp``
        slot, e.g. a PPO critic's)."""
        if rows_per_call <= 0:
            raise ValueError(f"Scorer: rows_per_call={rows_per_call} must be positive")
        self.graphdef = graphdef
        self.mesh = mesh
        self.chunk_size = chunk_size or None
        ranks = row_ranks(mesh)
        self.rows_per_call = -(-rows_per_call // ranks) * ranks
        self.row_len = row_len
        self.temperature = float(temperature)
        self.row_scores = row_scores
        self.compiles = 0
        self.last_compile = ""  # the shapes the last compile was for (trainers log it)
        self._programs: dict[tuple, Any] = {}  # by the parameters' PartitionSpecs

    # -- the program --------------------------------------------------------------------------
    def _jitted(self, params: Any, rows_BT: dict[str, jax.Array], temperature: jax.Array):
        """The program for ``params``' placement: their fsdp shards enter as such (ZeRO-3)."""
        specs = _param_specs(params, self.mesh)
        key = tuple(jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P)))
        if key not in self._programs:
            self._programs[key] = jax.jit(functools.partial(self._program, specs=specs))
        return self._programs[key](params, rows_BT, temperature)

    def _program(self, params, rows_BT, temperature, *, specs):
        self.compiles += 1  # runs only while tracing, i.e. once per compilation
        self.last_compile = f"rows [C, T] = {list(rows_BT['tokens'].shape)}"
        return self._rows(params, rows_BT, temperature, specs)

    def _rows(self, params: Any, rows_BT: dict[str, jax.Array], temperature: jax.Array, specs):
        manual = () if self.mesh is None else manual_batch_axes(self.mesh)
        zero3 = as_shards(specs, manual)

        def per_rank(rows_MT: dict[str, jax.Array], shards: Any = None):  # rows one at a time
            # whole parameters are closed over; ZeRO-3 shards enter marked for gathering
            model = nnx.merge(self.graphdef, marked(shards, specs, manual) if zero3 else params)

            def one(row_T: dict[str, jax.Array]):
                mb_1T = {k: v[None] for k, v in row_T.items()}
                scores = self.row_scores(
                    model, mb_1T, chunk_size=self.chunk_size, temperature=temperature
                )
                logp_1T, entropy_1T, correct_1T = scores
                return RowScores(logp=logp_1T[0], entropy=entropy_1T[0], correct=correct_1T[0])

            return jax.lax.map(one, rows_MT)

        # the train step's structure (jaxrl.train.accumulate): manual over the batch axes,
        # parameters replicated over them or as their fsdp shards, one [1, T] row per rank at
        # a time; the same program shape gives the train step's forward values, also in bf16.
        # No mesh, or one rank over several tensor devices: XLA partitions it (no shard_map)
        in_specs, args = (P(manual),), (rows_BT,)
        if zero3:
            in_specs, args = (P(manual), fsdp_in_specs(specs)), (rows_BT, params)
        mapped = per_rank_map(per_rank, self.mesh, in_specs=in_specs, out_specs=P(manual))
        return mapped(*args)

    # -- rows -------------------------------------------------------------------------------
    def score(
        self, params: Any, rows: Mapping[str, np.ndarray], *, temperature: float | None = None
    ) -> RowScores:
        """Score host rows ``rows[f]`` of shape ``[..., T]`` for f in :data:`ROW_FIELDS`
        (e.g. a packed batch's ``[R, M, T]``); results have the same shape. With a
        ``loss_mask`` field the head runs only where it is non-zero, as in the train step
        (``jaxrl.train.forward``): values elsewhere are 0 (``correct`` False). Fields named
        ``moe_*`` (a MoE rollout's recorded routes and replay flag, ``moe/trace.py``) reach
        the forward too, which then replays the routes as the train step's does; so does
        ``parent_ids`` (shared-prompt rows, ``jaxrl.data.batching.shared_prompt``)."""
        temp = self.temperature if temperature is None else float(temperature)
        shape = np.shape(rows["tokens"])
        t = shape[-1]
        flat = {k: np.asarray(rows[k], np.int32).reshape(-1, t) for k in ROW_FIELDS}
        if MASK_FIELD in rows:  # the head runs only where it is non-zero
            flat[MASK_FIELD] = (np.asarray(rows[MASK_FIELD]) != 0).astype(np.int32).reshape(-1, t)
        for k in rows:  # float token fields the forward reads (router replay's routes)
            if k.startswith(FORWARD_FIELD_PREFIX):
                flat[k] = np.asarray(rows[k], np.float32).reshape(-1, t)
        if PARENT_FIELD in rows:  # shared-prompt packing: each token's parent segment
            flat[PARENT_FIELD] = np.asarray(rows[PARENT_FIELD], np.int32).reshape(-1, t)
        live = np.flatnonzero((flat["segment_ids"] > 0).any(axis=1))
        n = flat["tokens"].shape[0]
        logp = np.zeros((n, t), np.float32)
        entropy = np.zeros((n, t), np.float32)
        correct = np.zeros((n, t), bool)
        c = self._call_rows(live.size)
        temperature_arg = put_replicated(np.float32(temp), self.mesh)
        calls = []  # every call is dispatched before the first result is read back
        for lo in range(0, live.size, c):
            idx = live[lo : lo + c]
            batch = {}
            for name, arr in flat.items():
                block = np.zeros((c, t), arr.dtype)
                block[: idx.size] = arr[idx]
                batch[name] = put_rows(block, self.mesh)
            with on_mesh(self.mesh):
                calls.append((idx, self._jitted(params, batch, temperature_arg)))
        for idx, out in calls:
            host = to_host(out)
            logp[idx] = host.logp[: idx.size]
            entropy[idx] = host.entropy[: idx.size]
            correct[idx] = host.correct[: idx.size]
        return RowScores(
            logp=logp.reshape(shape), entropy=entropy.reshape(shape), correct=correct.reshape(shape)
        )

    def _call_rows(self, live: int) -> int:
        """Rows per call for ``live`` rows: ``rows_per_call``, or fewer when fewer rows are
        live (a power of two per rank, so few programs compile): every row of a call is
        computed, padding included."""
        ranks = row_ranks(self.mesh)
        per_rank = 1 << max(-(-live // ranks) - 1, 0).bit_length()
        return min(self.rows_per_call, ranks * per_rank)

    # -- consumers --------------------------------------------------------------------------
    def documents(
        self,
        params: Any,
        packed: PackedBatch,
        *,
        mean: bool = False,
        temperature: float | None = None,
    ) -> DocumentScores:
        """Per-document values of a packed batch: ``sequence_logps`` of the scored log-probs
        (the training aggregation: sum, or mean with the count clamped at 1) and exact match."""
        scores = self.score(params, _rows_of(packed, masked=True), temperature=temperature)
        t, s = packed.shape[-1], packed.num_segments
        segment_ids_BT = packed.segment_ids.reshape(-1, t)
        loss_mask_BT = packed.loss_mask.reshape(-1, t)
        index_BS = packed.doc_sample_index.reshape(-1, s)
        values_BS = np.asarray(
            _sequence_values(scores.logp.reshape(-1, t), loss_mask_BT, segment_ids_BT, s, mean)
        )
        # exact match: count loss tokens and wrong loss tokens per (row, segment)
        on_BT = (loss_mask_BT > 0) & (segment_ids_BT > 0)
        wrong_BT = on_BT & ~scores.correct.reshape(-1, t)
        slot_BT = np.arange(index_BS.shape[0])[:, None] * s + segment_ids_BT
        count_BS = np.bincount(slot_BT[on_BT], minlength=index_BS.size).reshape(index_BS.shape)
        wrong_BS = np.bincount(slot_BT[wrong_BT], minlength=index_BS.size).reshape(index_BS.shape)
        at_BS = index_BS >= 0
        at_BS[:, 0] = False  # slot 0 is padding
        ids = index_BS[at_BS]
        num_docs = int(ids.max()) + 1 if ids.size else 0
        logps = np.full(num_docs, np.nan, np.float32)
        scored = np.zeros(num_docs, bool)
        correct = np.zeros(num_docs, bool)
        logps[ids] = values_BS[at_BS]
        scored[ids] = count_BS[at_BS] > 0
        correct[ids] = scored[ids] & (wrong_BS[at_BS] == 0)
        return DocumentScores(logps=logps, correct=correct, scored=scored)

    def token_logprobs(
        self,
        params: Any,
        sequences: Sequence[np.ndarray],
        *,
        temperature: float | None = None,
        token_fields: Mapping[str, Sequence[np.ndarray]] | None = None,
        prompt_lengths: Sequence[int] | None = None,
        loss_masks: Sequence[np.ndarray] | None = None,
    ) -> list[np.ndarray]:
        """Token-aligned log-probs per document: value i is log p(token i | tokens < i); 0 at 0.

        The documents are packed into rows of ``row_len`` tokens (the constructor's).
        ``token_fields``: per-document float fields packed with them as the train step's
        batches are; the ``moe_*`` ones reach the forward (a MoE rollout's recorded routes and
        replay flag: the scoring forward replays them, docs/moe.md). ``prompt_lengths`` (with
        the documents' ``loss_masks``): score in the shared-prompt layout, one copy of a prompt
        per row for the documents that share it (``shared_prompt.pack_shared_sequences``,
        docs/algorithms/grpo.md §12); the values are the same."""
        if self.row_len is None:
            raise ValueError("Scorer.token_logprobs needs the Scorer's row_len")
        fields = dict(token_fields or {})
        if prompt_lengths is None:
            packed = pack_sequences(list(sequences), row_len=self.row_len, token_fields=fields)
            split = packed.split_by_sample
        else:
            packed = pack_shared_sequences(
                list(sequences),
                prompt_lengths,
                row_len=self.row_len,
                loss_masks=loss_masks,
                token_fields=fields,
            )
            split = functools.partial(split_shared_by_sample, packed)
        rows = _rows_of(packed)
        rows.update(
            {k: v for k, v in packed.token_fields.items() if k.startswith(FORWARD_FIELD_PREFIX)}
        )
        if prompt_lengths is not None:
            rows[PARENT_FIELD] = packed.parent_ids
        logp = self.score(params, rows, temperature=temperature).logp
        by_doc = split(logp)  # value j predicts token j + 1
        return [
            np.concatenate([[0.0], by_doc[i][:-1]]).astype(np.float32)
            for i in range(len(sequences))
        ]

    def step_entropy_threshold(
        self,
        params: Any,
        arrays: Mapping[str, np.ndarray],
        top_entropy_quantile: float,
        *,
        temperature: float | None = None,
    ) -> float:
        """τ_H over every loss token of a step's packed ``[R, M, T]`` batch (all ranks): the
        ``entropy_threshold`` quantile of the scored entropies."""
        entropy = self.score(params, arrays, temperature=temperature).entropy
        tau = _entropy_threshold(entropy, np.asarray(arrays["loss_mask"]), top_entropy_quantile)
        return float(tau)


def _param_specs(params: Any, mesh: Mesh | None) -> Any:
    """The PartitionSpecs of ``params`` on ``mesh`` (None when they are not all placed on it
    by NamedShardings: they then enter the program whole)."""
    if mesh is None:
        return None
    leaves = jax.tree.leaves(params)
    shardings = [getattr(x, "sharding", None) for x in leaves]
    if not all(isinstance(s, NamedSharding) and s.mesh == mesh for s in shardings):
        return None
    return jax.tree.unflatten(jax.tree.structure(params), [s.spec for s in shardings])


def _rows_of(packed: PackedBatch, *, masked: bool = False) -> dict[str, np.ndarray]:
    names = ROW_FIELDS + ((MASK_FIELD,) if masked else ())
    return {name: getattr(packed, name) for name in names}
