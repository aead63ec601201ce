"""Engine sessions: decode slots that live across calls, for conversations that go on (tool
episodes, ``jaxrl/rollout/episodes.py``).

``Sampler.session(slots, max_length)`` holds ``slots`` decode slots of ``max_length`` entries
each (the cache ``[Nl, Sl, L, K, Dh]`` of ``models/slot_kv_cache.py`` stays on the device between
calls). :meth:`EngineSession.generate` is one engine call for every slot that takes part in a
turn: slot s gets its new tokens (the prompt on its first turn; later, what the environment
said) appended after everything it holds, then generates one completion from them
(``engine.continue_slots``); the completion's tokens stay in the slot too. So a conversation is
prefilled once, token by token as it grows, instead of re-prefilling all of it every turn.

Random bits: slot s's token t is drawn with ``fold_in(keys[s], t)``, so what a slot generates
depends on its key, its own conversation, its limit and the weights only (not on the other
slots). With ``keys[s] = fold_in(k, 0)`` a slot draws exactly the tokens request 0 of
``Sampler.generate([conversation], k)`` draws; the log-probs agree to float reduction order (the
conversation's keys and values were computed turn by turn, not in one prefill).

MoE models: ``SampleResult.routes`` holds, per slot, the expert ids of the turn's new tokens
then of its generated tokens (the last one included: it is fed), so a conversation's turns
concatenate to the routes of its whole sequence (router replay, docs/moe.md).

Programs: one per (slots, L, E), E the longest new-token list so far in the session rounded up
to a power of two >= 8 (a later turn's shorter lists reuse the first turn's program); the
sampling parameters, keys, limits and tokens are traced.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.generate.cache_geometry import batch_bucket
from jaxrl.generate.sampling import SampleResult, SamplingParams
from jaxrl.models.slot_kv_cache import SlotKVCache
from jaxrl.runtime.mesh import to_host
from jaxrl.runtime.spmd import on_mesh, put_replicated, put_rows, row_ranks

__all__ = ["EngineSession"]


class EngineSession:
    """``slots`` live decode slots of ``max_length`` entries (module doc). Slot s is empty until
    its first :meth:`generate`; ``lengths[s]`` is what it holds."""

    def __init__(self, sampler: Any, slots: int, max_length: int):
        """``sampler``: the ``jaxrl.generate.sampler.Sampler`` whose weights and programs the
        session uses (``Sampler.session`` opens one)."""
        if slots < 1 or max_length < 2:
            raise ValueError(f"EngineSession: slots={slots}, max_length={max_length}: need >= 1, 2")
        self.sampler = sampler
        self.slots = slots
        ranks = row_ranks(sampler.mesh)
        self._rows = -(-batch_bucket(slots) // ranks) * ranks  # slots, padded for the program
        block = sampler.attention_block
        self.cache_length = -(-max_length // block) * block
        self.lengths = np.zeros(slots, np.int64)
        self._cache: SlotKVCache | None = None
        self._width = 0

    def generate(
        self,
        new_tokens: Sequence[Sequence[int] | None],
        keys: jax.Array | Sequence[jax.Array | None],
        sampling: SamplingParams | None = None,
        *,
        max_tokens: Sequence[int],
    ) -> SampleResult:
        """One turn: slot s (``new_tokens[s]`` not None, non-empty) appends its new tokens and
        generates up to ``max_tokens[s]`` tokens with ``keys[s]`` (``keys``: a typed key array
        ``[S]``, or one key per slot, None where it sits out); slots given None sit the turn out
        (their rows of the result are empty). Rows of the result are the slots."""
        sampler = self.sampler
        n, s = sampler.max_new_tokens, self.slots
        if len(new_tokens) != s or len(keys) != s or len(max_tokens) != s:
            raise ValueError(f"EngineSession.generate: give {s} new-token lists, keys and limits")
        run = [t is not None for t in new_tokens]
        if not any(run):
            raise ValueError("EngineSession.generate: no slot takes part in this turn")
        sizes = np.asarray([len(t) if t is not None else 0 for t in new_tokens], np.int64)
        limits = np.asarray([m if r else 0 for m, r in zip(max_tokens, run, strict=True)])
        if any(
            r and (z < 1 or not 1 <= m <= n) for r, z, m in zip(run, sizes, limits, strict=True)
        ):
            raise ValueError(
                f"EngineSession.generate: each taking part needs >= 1 new token and a limit in "
                f"[1, {n}]; got sizes {sizes.tolist()}, limits {limits.tolist()}"
            )
        end = self.lengths + sizes + limits
        if (end > self.cache_length).any():
            raise ValueError(
                f"EngineSession.generate: slots {np.flatnonzero(end > self.cache_length).tolist()}"
                f" would outgrow their {self.cache_length} entries; open the session with a "
                "larger max_length"
            )
        # the widest new-token bucket so far: later turns (shorter) reuse the first's program
        self._width = width = max(self._width, 8, 1 << (int(sizes.max()) - 1).bit_length())
        rows = self._rows
        new_SlE = np.full((rows, width), sampler.pad_id, np.int32)
        for i, t in enumerate(new_tokens):
            if t is not None:
                new_SlE[i, : len(t)] = t
        pad = lambda x: np.concatenate([x, np.zeros(rows - s, x.dtype)])  # noqa: E731
        key_data, key_impl = _key_data(keys, run)
        keys_Sl = np.zeros((rows, *key_data.shape[1:]), key_data.dtype)
        keys_Sl[:s] = key_data
        if self._cache is None:
            self._cache = self._empty_cache()
        sp = sampling or sampler.sampling
        mesh = sampler.mesh
        rep = lambda x: put_replicated(x, mesh)  # noqa: E731
        stop = None if sampler.stop is None else rep(sampler.stop.transitions)
        with on_mesh(mesh):
            out = sampler._jitted_session(
                sampler.weights.get(),
                self._cache,
                put_rows(pad(self.lengths.astype(np.int32)), mesh),
                put_rows(new_SlE, mesh),
                put_rows(pad(sizes.astype(np.int32)), mesh),
                put_rows(keys_Sl, mesh),
                put_rows(pad(limits.astype(np.int32)), mesh),
                rep(np.float32(sp.temperature)),
                rep(np.int32(sp.top_k)),
                rep(np.float32(sp.top_p)),
                stop,
                shape=sampler.engine_shape(rows, self.cache_length, 0),
                key_impl=key_impl,
            )
        self._cache = out.cache  # the slots' cache stays on the devices (the next turn's input)
        host = to_host(dataclasses.replace(out, cache=None))  # an engine.EngineResult
        lengths = np.where(run, host.lengths_Rq[:s], 0).astype(np.int32)
        routes = None
        if host.routes_RqNLK is not None:  # MoE: each slot's new tokens' routes, then its own
            new_SlELK, gen_SlNLK = host.prompt_routes, host.routes_RqNLK
            routes = [
                np.concatenate([new_SlELK[i, : sizes[i]], gen_SlNLK[i, : lengths[i]]])
                for i in range(s)
            ]
        self.lengths = self.lengths + np.where(run, sizes + lengths, 0)
        return SampleResult(
            tokens=host.tokens_RqN[:s],
            logprobs=host.logprobs_RqN[:s],
            lengths=lengths,
            truncated=host.truncated_Rq[:s] & np.asarray(run),
            prompt_lengths=self.lengths.astype(np.int32) - lengths,
            num_steps=int(host.steps),
            weight_version=sampler.weight_version,
            routes=routes,
        )

    def _empty_cache(self) -> SlotKVCache:
        sampler = self.sampler  # placed over the mesh by the program (engine.continue_slots)
        cache = SlotKVCache.empty(
            sampler.config, self._rows, self.cache_length, sampler.attention_block
        )  # keys and values: two buffers, as the program donates both
        return dataclasses.replace(cache, values=jnp.zeros_like(cache.keys))

    def close(self) -> None:
        """Drop the slots' cache."""
        self._cache = None


def _key_data(keys: Any, run: Sequence[bool]) -> tuple[np.ndarray, str | None]:
    """Raw key data ``[S, ...]`` of per-slot keys (a typed key array ``[S]``, or a sequence of
    typed or raw keys, None where a slot sits out), and the typed keys' implementation."""
    if isinstance(keys, jax.Array) and jnp.issubdtype(keys.dtype, jax.dtypes.prng_key):
        return np.asarray(jax.random.key_data(keys)), str(jax.random.key_impl(keys))
    given = [k for k, r in zip(keys, run, strict=True) if r]
    typed = jnp.issubdtype(given[0].dtype, jax.dtypes.prng_key)
    data = np.stack([np.asarray(jax.random.key_data(k) if typed else k) for k in given])
    out = np.zeros((len(run), *data.shape[1:]), data.dtype)
    out[np.flatnonzero(run)] = data
    return out, str(jax.random.key_impl(given[0])) if typed else None
