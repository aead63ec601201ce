"""No-grad forwards over packed rows: old/reference log-probs and the step's entropy threshold.

Rows are processed one at a time (``lax.map`` over ``[1, T]`` rows), the shape the train step's
micro-batches have, through the same ``micro_batch_logprobs`` (same head, same temperature). One
program is compiled per (rows, T) bucket.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.nnx as nnx
import jax
import numpy as np

from jaxrl.data.packing import pack_sequences
from jaxrl.losses.policy import entropy_threshold
from jaxrl.train.forward import micro_batch_logprobs

ROW_FIELDS = ("tokens", "targets", "segment_ids", "positions")


class Scorer:
    """Per-token log-probs / entropies of packed rows under given parameters (no gradient)."""

    def __init__(self, graphdef: Any, *, row_len: int, temperature: float, chunk_size: int = 0):
        self.graphdef = graphdef
        self.row_len = row_len
        self.temperature = float(temperature)
        self.chunk_size = chunk_size or None
        self._rows = jax.jit(self._rows_logprobs)
        self._threshold = jax.jit(self._entropy_threshold, static_argnums=3)

    def _rows_logprobs(self, params: Any, rows_NT: dict[str, jax.Array]):
        model = nnx.merge(self.graphdef, params)

        def one(row_T: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
            mb = {k: v[None] for k, v in row_T.items()}
            logp, ent = micro_batch_logprobs(
                model, mb, chunk_size=self.chunk_size, temperature=self.temperature
            )
            return logp[0], ent[0]

        return jax.lax.map(one, rows_NT)

    def _entropy_threshold(
        self, params: Any, rows_NT: dict[str, jax.Array], mask_NT: jax.Array, q: float
    ) -> jax.Array:
        _, entropy_NT = self._rows_logprobs(params, rows_NT)
        return entropy_threshold(entropy_NT, mask_NT, q)

    def token_logprobs(self, params: Any, sequences: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Token-aligned log-probs per document: value i is log p(token i | tokens < i); 0 at 0."""
        packed = pack_sequences(list(sequences), row_len=self.row_len)
        rows = {k: getattr(packed, k)[0] for k in ROW_FIELDS}
        logp_NT, _ = self._rows(params, rows)
        logp_RKT = np.asarray(logp_NT)[None]
        by_doc = packed.split_by_sample(logp_RKT)  # value j predicts token j + 1
        out = []
        for i in range(len(sequences)):
            vals = by_doc[i]
            out.append(np.concatenate([[0.0], vals[:-1]]).astype(np.float32))
        return out

    def step_entropy_threshold(
        self, params: Any, arrays: dict[str, np.ndarray], top_entropy_quantile: float
    ) -> float:
        """τ_H over every loss token of a step's packed ``[R, K, T]`` batch (all ranks)."""
        flat = {k: arrays[k].reshape(-1, arrays[k].shape[-1]) for k in ROW_FIELDS}
        mask = arrays["loss_mask"].reshape(-1, arrays["loss_mask"].shape[-1])
        return float(self._threshold(params, flat, mask, float(top_entropy_quantile)))
