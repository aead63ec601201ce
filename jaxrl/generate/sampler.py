"""The sampler: prompts in, completions with their log-probs out, by continuous batching.

``Sampler.generate(prompts, key)`` generates one completion per prompt row with the engine of
``engine.py``: identical prompt rows (a GRPO group's G copies) are prefilled once, and a fixed
number of decode slots (``max_slots``; 0 = one per request) is refilled, inside the compiled
program, as requests stop (eos, a stop string, or their own ``max_tokens``). Rows may be given in
any order; results come back in the rows' order.

Shapes and programs. Requests are padded to a batch bucket (:func:`batch_bucket`: 1, 2, 3, 4,
6, 8, 12, ...), distinct prompts likewise, and the prompts right-padded to a prompt bucket P
(``prompt_buckets`` as in ``jaxrl.data.batching.packing.pick_bucket``; None = the same ladder). One
program is compiled per (requests bucket, prompts bucket, P); slots, N = ``max_new_tokens``,
the refill interval and the stop strings are fixed per sampler. Sampling parameters, the key,
the prompts' contents and lengths and the per-request limits are traced, so changing them never
recompiles (``Sampler.compiles`` counts traces).

Numerics match the trainer (docs/algorithms/accumulation.md §5 and §7): logits come from the
model's own head (``Transformer.logits``, an fp32 HIGHEST matmul when ``fp32_lm_head``), and
the reported log-prob of a sampled token is the full-vocabulary ``log_softmax(logits / T)`` at
it (``sampling.py``).

Random bits (``sampling.token_key``). Token t of request r (row r of the call) is drawn with
``fold_in(fold_in(key, r), t)``: a function of (key, r, t) only. The same key gives the same
completions for any slot count, refill interval, batch bucket or mesh. A GRPO trainer passes
``fold_in(key(seed), generation)`` and lays rows out prompt-major, so row ``r = i·G + j`` is
completion j of prompt i.

Placement. With a ``mesh`` the decode slots (and their cache) and the prompt groups' prefill are
split over its batch axes (data × fsdp; slot and group counts are rounded up to a multiple of
the row ranks; a refilled slot gathers its group's prompt cache from wherever it lies);
parameters stay in the sharding they have and XLA partitions the model around them
(``jaxrl.runtime.spmd``). Results come back with ``jaxrl.runtime.mesh.to_host`` on every
process.

Weights (``sampler_weights.py``): ``load_params`` copies the trainer's parameters in the
compute dtype by default (``copy_params=True``: generation may run while the trainer trains and
donates its buffers); ``copy_params=False`` reads arrays already in the compute dtype in place
(the synchronous case), so the run holds no second copy of the model.

The previous static-batch sampler is ``benchmarks/static_sampler.py`` (the benchmark baseline);
its dense-cache building blocks are ``dense_decode.py``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxrl.data.batching.packing import BucketSpec
from jaxrl.generate.backend import RolloutBackend
from jaxrl.generate.cache_geometry import (
    CacheGeometry,
    batch_bucket,
    cache_geometry,
    compact_sizes,
    prompt_rows,
)
from jaxrl.generate.engine import EngineShape, continue_slots, decode_requests
from jaxrl.generate.sampler_weights import SamplerWeights, decode_model
from jaxrl.generate.sampling import (
    SampleResult,
    SamplingParams,
    filter_logits,
    sample_tokens,
    stop_token_ids,
    token_key,
)
from jaxrl.generate.session import EngineSession
from jaxrl.generate.stop import StopStrings
from jaxrl.models.model_config import ModelConfig
from jaxrl.models.sharding import bytes_per_device
from jaxrl.models.slot_kv_cache import DECODE_BLOCK, SlotKVCache
from jaxrl.runtime.background_compile import BackgroundCompiles
from jaxrl.runtime.compile_options import program_options
from jaxrl.runtime.mesh import to_host
from jaxrl.runtime.spmd import on_mesh, placing_abstractly, put_replicated, put_rows, row_ranks

__all__ = [
    "SampleResult",
    "Sampler",
    "SamplingParams",
    "StopStrings",
    "batch_bucket",
    "compact_sizes",
    "filter_logits",
    "sample_tokens",
    "token_key",
]


class _EngineCall(NamedTuple):
    """A :meth:`Sampler.generate` call's program arguments after the parameters."""

    args: tuple[Any, ...]
    shape: EngineShape
    key_impl: str | None
    group_Rq: list[int]  # each request's distinct prompt
    program: Hashable  # what picks the compiled program: the static part and every shape


class Sampler(RolloutBackend):
    """Continuous-batching sampling from a :class:`Transformer`; weights via ``load_params``.
    The engine behind the rollout interface (:class:`jaxrl.generate.backend.RolloutBackend`).

    ``max_slots``: decode slots (0 = one per request of the call, bucketed). ``refill_every``:
    empty slots take waiting requests every k decode steps. ``stop``: stop strings
    (:class:`StopStrings`, built over the tokenizer's vocabulary). ``prefill_chunk``: prefill
    prompts C tokens at a time (0 = whole). ``attention_block``: decode-attention block (the
    cache length is a multiple of it). ``copy_params``: see the module doc. ``mesh``: split the
    slots over its batch axes (None: run where the parameters are). ``pack_prompts``:
    prefill several distinct prompts per row (``cache_geometry.prompt_rows``; False: one
    right-padded prompt per row). ``scan_layers``: decode a model with stacked layers
    (``ModelConfig.scan_layers``) in its layer scan: shorter compiles, slower steps (default:
    unrolled, ``sampler_weights.decode_model``). ``compact_slots``: once every request is
    admitted and the live slots fit a half (then a quarter) of the slots, decode on in that many
    slots (:func:`compact_sizes`; ``engine.py``, "Compaction"); False: every step runs every
    slot (one step body compiled, not up to three).
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        max_new_tokens: int,
        eos_id: int | Sequence[int],
        pad_id: int,
        sampling: SamplingParams | None = None,
        prompt_buckets: BucketSpec = None,
        mesh: Mesh | None = None,
        max_slots: int = 0,
        refill_every: int = 1,
        stop: StopStrings | None = None,
        prefill_chunk: int = 0,
        attention_block: int = DECODE_BLOCK,
        copy_params: bool = True,
        pack_prompts: bool = True,
        scan_layers: bool = False,
        compact_slots: bool = True,
    ):
        eos_ids = stop_token_ids("Sampler", config.vocab_size, eos_id, pad_id)
        for name, value, low in (
            ("max_new_tokens", max_new_tokens, 1),
            ("max_slots", max_slots, 0),
            ("refill_every", refill_every, 1),
            ("prefill_chunk", prefill_chunk, 0),
            ("attention_block", attention_block, 1),
        ):
            if not isinstance(value, int) or value < low:
                raise ValueError(f"Sampler: {name}={value!r} must be an int >= {low}")
        if stop is not None and stop.transitions.shape[1] != config.vocab_size:
            raise ValueError(
                f"Sampler: stop strings built over {stop.transitions.shape[1]} tokens, the "
                f"model has {config.vocab_size}: build them from the model's tokenizer"
            )
        config, self._graphdef, abstract_params = decode_model(
            config, scan_layers=scan_layers and config.scan_layers
        )
        self.config = config
        self.max_new_tokens = max_new_tokens
        self.eos_ids = eos_ids
        self.pad_id = int(pad_id)
        self.sampling = sampling or SamplingParams()
        self.prompt_buckets = prompt_buckets
        self.mesh = mesh
        self.max_slots = max_slots
        self.refill_every = refill_every
        self.stop = stop
        self.prefill_chunk = prefill_chunk
        self.attention_block = attention_block
        self.copy_params = copy_params
        self.pack_prompts = pack_prompts
        self.compact_slots = compact_slots
        self.compiles = 0
        self.last_compile = ""  # the shapes the last compile was for (trainers log it)
        self.weights = SamplerWeights(abstract_params, mesh)
        self._precompiled = BackgroundCompiles()  # programs compiled ahead (``precompile``)
        self.weight_version = -1  # the version of the weights loaded last
        options = program_options()
        self._jitted = jax.jit(
            self._program, static_argnames=("shape", "key_impl"), compiler_options=options
        )
        self._jitted_session = jax.jit(
            self._session_program,
            static_argnames=("shape", "key_impl"),
            donate_argnums=(1,),
            compiler_options=options,
        )

    # -- weights ------------------------------------------------------------------------------
    def load_params(
        self, params: Any, *, copy: bool | None = None, version: int | None = None
    ) -> None:
        """Load a trainer's parameters (a :class:`Transformer` or its ``nnx.State``): a
        compute-dtype copy, or with ``copy=False`` (default: ``copy_params``) the arrays
        themselves where they are in the compute dtype (``sampler_weights.py``). ``version``
        (default: the last + 1) is reported with every result they generate."""
        self.weights.load(params, copy=self.copy_params if copy is None else copy)
        self.weight_version = self.weight_version + 1 if version is None else int(version)

    def release(self) -> None:
        """Drop the loaded weights (and any reference to a trainer's arrays)."""
        self.weights.release()

    @property
    def _params(self) -> Any:
        return self.weights.params

    # -- shapes -------------------------------------------------------------------------------
    def cache_geometry(
        self, num_requests: int, num_groups: int, longest_prompt: int
    ) -> CacheGeometry:
        """The KV caches of a call of ``num_requests`` requests over ``num_groups`` distinct
        prompts of at most ``longest_prompt`` tokens (``cache_geometry.py``)."""
        return cache_geometry(
            num_requests,
            num_groups,
            longest_prompt,
            max_new_tokens=self.max_new_tokens,
            max_slots=self.max_slots,
            ranks=row_ranks(self.mesh),
            block=self.attention_block,
            prompt_buckets=self.prompt_buckets,
            prefill_chunk=self.prefill_chunk,
        )

    def memory_bytes(self, num_requests: int, num_groups: int, longest_prompt: int) -> int:
        """Bytes of the KV caches of such a call on the largest device (the slots split over
        the row ranks and, tensor-parallel, over KV heads when ``tensor`` divides them; the
        prompt groups' cache counted whole; with compaction, the first gather's copy of the
        slots' cache at the largest smaller size too, which lives beside the full one)."""
        geometry = self.cache_geometry(num_requests, num_groups, longest_prompt)
        ranks = row_ranks(self.mesh)
        tensor = 1 if self.mesh is None else self.mesh.shape.get("tensor", 1)
        split = tensor if self.config.num_key_value_heads % tensor == 0 else 1
        largest = max(self._compact(geometry.slots), default=0)
        gathered = SlotKVCache.nbytes(self.config, largest, geometry.cache_length, 1)
        return geometry.nbytes_per_device(self.config, ranks, kv_split=split) + gathered // split

    def weight_bytes(self) -> int:
        """Bytes on the largest device of the compute-dtype weights it decodes with, in its
        layout (``decode_layout.py``; whole without a mesh)."""
        if self.weights.shardings is None:
            return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self.weights.abstract))
        return bytes_per_device(self.weights.abstract, self.weights.shardings)

    def _compact(self, slots: int) -> tuple[int, ...]:
        """The smaller slot counts a program of ``slots`` slots compacts into (none when off)."""
        return compact_sizes(slots, row_ranks(self.mesh)) if self.compact_slots else ()

    def engine_shape(self, slots: int, cache_length: int, prompt_length: int) -> EngineShape:
        """The static part of an engine program of this sampler."""
        return EngineShape(
            compact=self._compact(slots),
            slots=slots,
            max_new_tokens=self.max_new_tokens,
            cache_length=cache_length,
            block=self.attention_block,
            refill_every=self.refill_every,
            prefill_chunk=self.prefill_chunk,
            pad_id=self.pad_id,
            eos_ids=self.eos_ids,
            prompt_length=prompt_length,
        )

    # -- generation ---------------------------------------------------------------------------
    def session(self, slots: int, max_length: int) -> EngineSession:
        """``slots`` decode slots of ``max_length`` entries that keep what they hold between
        calls, for conversations that go on (``session.py``; tool episodes)."""
        return EngineSession(self, slots, max_length)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        key: jax.Array,
        sampling: SamplingParams | None = None,
        *,
        max_tokens: Sequence[int] | np.ndarray | None = None,
    ) -> SampleResult:
        """One completion per prompt row (token-id sequences, each non-empty).

        ``max_tokens``: each row's own limit (``1..max_new_tokens``; default
        ``max_new_tokens``); a row that reaches it without eos or a stop string is truncated.
        """
        params = self.weights.get()
        call = self._call(prompts, key, sampling, max_tokens)
        self._precompiled.wait(call.program)  # compiling on the background thread: wait for it
        with on_mesh(self.mesh):
            out = self._jitted(params, *call.args, shape=call.shape, key_impl=call.key_impl)
        host = to_host(out)  # an engine.EngineResult of numpy arrays
        lengths, routes = host.lengths_Rq, None
        if host.routes_RqNLK is not None:  # MoE: each row's prompt routes, then its completion's
            prompt_QPLK, completion_RqNLK = host.prompt_routes, host.routes_RqNLK
            routes = [
                np.concatenate([prompt_QPLK[g, : len(p)], completion_RqNLK[i, : lengths[i]]])
                for i, (g, p) in enumerate(zip(call.group_Rq, prompts, strict=True))
            ]
        return SampleResult.of(
            prompts, host.tokens_RqN, host.logprobs_RqN, lengths, host.truncated_Rq,
            num_steps=int(host.steps), compacted_steps=int(host.compacted_steps),
            weight_version=self.weight_version, routes=routes,
        )  # fmt: skip

    def precompile(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_tokens: Sequence[int] | np.ndarray | None = None,
        key: jax.Array | None = None,
    ) -> None:
        """Compile the program ``generate(prompts, key, max_tokens=max_tokens)`` runs, on a
        background thread, without running it: the call finds it compiled (and waits for it
        when it comes first). Its shapes depend only on the request count, the distinct prompts
        and their lengths (the module doc), so a trainer that knows its next generation's
        prompts compiles that program while it does other work (the held-out evaluation, the
        first weight copy). ``key``: one of the kind the call will pass (default
        ``jax.random.key(0)``). Compiles nothing for a program this sampler already has."""
        call = self._call(prompts, jax.random.key(0) if key is None else key, None, max_tokens)
        params = self.weights.params
        if params is None:  # not loaded yet: the layout a load gives them (sampler_weights.py)
            params = self.weights.abstract_loaded()

        def compile_program() -> None:
            with on_mesh(self.mesh):
                self._jitted.lower(
                    params, *call.args, shape=call.shape, key_impl=call.key_impl
                ).compile()

        self._precompiled.start(call.program, compile_program)

    def lower(self, prompts: Sequence[Sequence[int]], trainer_params: Any = None) -> dict[str, Any]:
        """The programs a generation over ``prompts`` runs, lowered and not run, by name:
        ``weight_reshard`` (the cast copy of ``trainer_params``, avals of the trainer's
        parameters, into the decode layout; only when given) and ``sampler_prefill_decode``
        (prefill and the decode loop, on the weights as a load leaves them). For a target
        compile (``jaxrl memory --topology``): arguments are placed abstractly, so the mesh may
        be of compile-only devices."""
        lowered = {}
        if trainer_params is not None:
            lowered["weight_reshard"] = self.weights.lower_copy(trainer_params)
        with placing_abstractly():
            call = self._call(prompts, jax.random.key(0), None, None)
        with on_mesh(self.mesh):
            lowered["sampler_prefill_decode"] = self._jitted.lower(
                self.weights.abstract_loaded(), *call.args, shape=call.shape,
                key_impl=call.key_impl,
            )  # fmt: skip
        return lowered

    def _call(
        self,
        prompts: Sequence[Sequence[int]],
        key: jax.Array,
        sampling: SamplingParams | None,
        max_tokens: Sequence[int] | np.ndarray | None,
    ) -> _EngineCall:
        """A :meth:`generate` call's program arguments (all but the parameters), checked."""
        b = len(prompts)
        if not b or any(len(p) == 0 for p in prompts):
            raise ValueError("Sampler.generate: need at least one prompt, each with >= 1 token")
        n = self.max_new_tokens
        limits = np.full(b, n, np.int32) if max_tokens is None else np.asarray(max_tokens)
        if limits.shape != (b,) or not ((limits >= 1) & (limits <= n)).all():
            raise ValueError(
                f"Sampler.generate: max_tokens must give one limit in [1, {n}] per prompt "
                f"({b}), got {np.asarray(max_tokens).tolist()}"
            )
        s = sampling or self.sampling
        groups: dict[tuple[int, ...], int] = {}
        group_Rq = [groups.setdefault(tuple(int(t) for t in p), len(groups)) for p in prompts]
        unique = list(groups)
        geometry = self.cache_geometry(b, len(unique), max(len(p) for p in unique))
        length = geometry.prompt_length
        ranks = row_ranks(self.mesh)  # the prefill's rows are split over the row ranks
        r_pad = batch_bucket(b)
        lengths_Q = np.asarray([len(p) for p in unique], np.int32)
        packing = prompt_rows(lengths_Q, length, ranks=ranks, pack=self.pack_prompts)
        prompts_RW = np.full((packing.rows, packing.width), self.pad_id, np.int32)
        segment_ids_RW = np.zeros((packing.rows, packing.width), np.int32)
        positions_RW = np.zeros((packing.rows, packing.width), np.int32)
        for q, p in enumerate(unique):
            row, col = packing.row_Q[q], packing.offset_Q[q]
            prompts_RW[row, col : col + len(p)] = p
            segment_ids_RW[row, col : col + len(p)] = q + 1
            positions_RW[row, col : col + len(p)] = np.arange(len(p))
        pad_Rq = np.zeros(r_pad - b, np.int32)
        pad_Q = lambda x: np.concatenate([x, np.zeros(geometry.groups - len(x), np.int32)])  # noqa: E731
        shape = self.engine_shape(geometry.slots, geometry.cache_length, length)
        if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
            key_impl, key_data = str(jax.random.key_impl(key)), jax.random.key_data(key)
        else:  # a raw uint32 key (jax.random.PRNGKey)
            key_impl, key_data = None, key
        rep = lambda x: put_replicated(x, self.mesh)  # noqa: E731
        stop = None if self.stop is None else rep(self.stop.transitions)
        args = (
            put_rows(prompts_RW, self.mesh),
            put_rows(segment_ids_RW, self.mesh),
            put_rows(positions_RW, self.mesh),
            rep(pad_Q(packing.start_Q)),
            rep(pad_Q(lengths_Q)),
            rep(np.concatenate([np.asarray(group_Rq, np.int32), pad_Rq])),
            rep(np.concatenate([limits.astype(np.int32), pad_Rq])),
            rep(np.int32(b)),
            rep(np.asarray(key_data)),
            rep(np.float32(s.temperature)),
            rep(np.int32(s.top_k)),
            rep(np.float32(s.top_p)),
            stop,
        )
        program = (shape, key_impl, *((x.shape, x.dtype.name) for x in args if x is not None))
        return _EngineCall(args, shape, key_impl, group_Rq, program)

    __call__ = generate

    def _program(
        self, params, prompts_RW, segment_ids_RW, positions_RW, start_Q, lengths_Q, group_Rq,
        max_tokens_Rq, num_requests, key_data, temperature, top_k, top_p, stop_ZV, *, shape,
        key_impl,
    ):  # fmt: skip
        self.compiles += 1  # runs only while tracing, i.e. once per compilation
        self.last_compile = (
            f"{group_Rq.shape[0]} requests over {start_Q.shape[0]} prompts in prefill rows "
            f"{list(prompts_RW.shape)}"
        )
        impl = {} if key_impl is None else {"impl": key_impl}  # None: a raw uint32 key
        key = jax.random.wrap_key_data(key_data, **impl)
        return decode_requests(
            nnx.merge(self._graphdef, params),
            shape,
            prompts_RW=prompts_RW,
            segment_ids_RW=segment_ids_RW,
            positions_RW=positions_RW,
            start_Q=start_Q,
            prompt_lengths_Q=lengths_Q,
            group_Rq=group_Rq,
            max_tokens_Rq=max_tokens_Rq,
            num_requests=num_requests,
            key=key,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            stop_ZV=stop_ZV,
            mesh=self.mesh,
            record_routes=bool(self.config.moe_layers),  # MoE: for router replay (docs/moe.md)
        )

    def _session_program(
        self, params, cache, lengths_Sl, new_SlE, new_lengths_Sl, key_data_Sl, max_tokens_Sl,
        temperature, top_k, top_p, stop_ZV, *, shape, key_impl,
    ):  # fmt: skip
        self.compiles += 1
        self.last_compile = f"a session of {new_SlE.shape[0]} slots, {new_SlE.shape[1]} new tokens"
        impl = {} if key_impl is None else {"impl": key_impl}
        keys_Sl = jax.random.wrap_key_data(key_data_Sl, **impl)
        return continue_slots(
            nnx.merge(self._graphdef, params),
            shape,
            cache,
            lengths_Sl=lengths_Sl,
            new_SlE=new_SlE,
            new_lengths_Sl=new_lengths_Sl,
            keys_Sl=keys_Sl,
            max_tokens_Sl=max_tokens_Sl,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            stop_ZV=stop_ZV,
            mesh=self.mesh,
            record_routes=bool(self.config.moe_layers),  # MoE: tool episodes' routes
        )
