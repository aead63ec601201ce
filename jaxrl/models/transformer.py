"""Decoder-only transformer of the Llama / Mistral / Qwen2 / Qwen3 / Gemma 2 / Gemma 3 family,
in Flax NNX.

Pre-norm blocks: ``x += attn(rms(x)); x += mlp(rms(x))``, grouped-query attention with RoPE
(``attention.py``), SwiGLU MLP ``down(silu(gate x) * up x)``, a final RMSNorm and an LM head
(``head.py``). Qwen2 adds q/k/v biases, Qwen3 a per-head RMSNorm on q and k before RoPE.
Gemma (docs/models.md): ``sqrt(D)``-scaled embeddings, RMSNorm with the ``(1 + w)`` weight,
norms on the attention and MLP outputs too (``x += norm(attn(norm(x)))``), GeGLU (tanh GELU),
``query_pre_attn_scalar``, attention and final logit soft-capping (Gemma 2), q/k norms
(Gemma 3). Any model may interleave sliding-window (local) and global layers
(``ModelConfig.layer_types``), each with its own RoPE base (Gemma 3).

Precision policy: parameters are stored in ``param_dtype`` and cast to the
compute ``dtype`` where used; RMSNorm statistics, attention scores and softmax are float32;
``fp32_lm_head`` computes logits as an fp32 x fp32 matmul at ``Precision.HIGHEST``.

Layer stack (``layer_stack.py``): ``scan_layers`` stores the blocks' parameters stacked on a
leading ``layers`` axis and runs them with one ``lax.scan`` (the compiled program holds the
block once); ``remat`` wraps each block in ``jax.checkpoint``. Neither changes the numbers.

Decoding: :meth:`Transformer.decode` runs new tokens against a preallocated KV cache
(``kv_cache.py``) under the same attention visibility rule; the training path (``__call__``,
``hidden_states``) does not touch the cache code.

Every parameter is an ``nnx.Param`` whose ``out_sharding`` metadata holds *logical* axis
names (``embed``, ``vocab``, ``heads``, ...); ``sharding.py`` maps them to mesh axes. No
Variable is shared between modules (the tied head reads the embedding), so the model also
runs in NNX tree mode.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl.models import fsdp
from jaxrl.models.adapters.lora_layer import adapt, adapter, lora_rngs, quantize_base
from jaxrl.models.attention.dense import apply_rope, positions_from_segments, rope_inv_freq
from jaxrl.models.attention.dispatch import attention_fn
from jaxrl.models.fsdp import is_marked, weight
from jaxrl.models.head import lm_head
from jaxrl.models.kv_cache import KVCache, LayerKV
from jaxrl.models.layer_stack import run_blocks, stack_blocks
from jaxrl.models.matmul import matmul
from jaxrl.models.model_config import GEMMA_TYPES, ModelConfig
from jaxrl.models.moe.layer import MoE
from jaxrl.models.moe.trace import MoeTrace, empty_trace, finish, replay_layers, trace_step
from jaxrl.models.slot_kv_cache import SlotKVCache

_INIT_STD = 0.02  # Hugging Face's default initializer_range.


def _param(
    key: jax.Array | None,
    shape: tuple[int, ...],
    axes: tuple[str, ...],
    dtype: str,
    init: str = "normal",
) -> nnx.Param:
    """A Param with logical-axis metadata; ``init`` is "normal" (std 0.02), "zeros" or "ones"."""
    if init == "normal":
        value = _INIT_STD * jax.random.normal(key, shape, jnp.float32)
    else:
        value = (jnp.zeros if init == "zeros" else jnp.ones)(shape, jnp.float32)
    return nnx.Param(value.astype(dtype), out_sharding=axes, eager_sharding=False)


class RMSNorm(nnx.Module):
    """``x / sqrt(mean(x^2) + eps) * scale``, statistics and product in float32; with
    ``plus_one`` (Gemma) the weight is stored as ``scale - 1`` (zero-initialised), as HF does."""

    def __init__(self, dim: int, *, eps: float, axis: str, param_dtype: str, plus_one=False):
        init = "zeros" if plus_one else "ones"
        self.scale = _param(None, (dim,), (axis,), param_dtype, init=init)
        self.eps = eps
        self.plus_one = plus_one

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        inv_rms = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        scale = weight(self.scale, jnp.float32).reshape((1,) * (x.ndim - 1) + (-1,))
        if self.plus_one:
            scale = 1.0 + scale
        return (x32 * inv_rms * scale).astype(x.dtype)


def _norm_kwargs(config: ModelConfig, axis: str) -> dict[str, Any]:
    return dict(
        eps=config.rms_norm_eps,
        axis=axis,
        param_dtype=config.param_dtype,
        plus_one=config.model_type in GEMMA_TYPES,
    )


def _kernel(variable: Any, dtype: Any, operands: str | None) -> jax.Array:
    """A projection's kernel for :func:`matmul`: as stored when it is stored in the
    ``operands`` dtype (the sampler's narrow copy, ``generate/sampler_weights.decode_model``:
    never widened and narrowed again), else in ``dtype``."""
    stored = variable.get_value().dtype if isinstance(variable, nnx.Variable) else None
    narrow = operands is not None and stored == jnp.dtype(operands)
    return weight(variable, stored if narrow else dtype)


def _project(x_BTD: jax.Array, kernel_DHDh: jax.Array, operands: str | None) -> jax.Array:
    """``x @ kernel`` for a [D, H, Dh] kernel, as one 2-D matmul (simpler HLO than einsum);
    ``operands``: ``ModelConfig.matmul_dtype`` (``matmul.py``)."""
    d, h, dh = kernel_DHDh.shape
    out = matmul(x_BTD, kernel_DHDh.reshape(d, h * dh), operands)
    return out.reshape(*x_BTD.shape[:-1], h, dh)


class Attention(nnx.Module):
    """Projections, optional q/k norm and RoPE around :func:`attention.attention`; layer
    ``layer``'s sliding window and RoPE base (``ModelConfig.layer_window`` / ``layer_rope``)."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        rngs: nnx.Rngs,
        lora_rngs: nnx.Rngs | None = None,
        layer: int = 0,
    ):
        d, h, k, dh = (
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        pd = config.param_dtype
        self.q_kernel = _param(rngs.params(), (d, h, dh), ("embed", "heads", "head_dim"), pd)
        self.k_kernel = _param(rngs.params(), (d, k, dh), ("embed", "kv_heads", "head_dim"), pd)
        self.v_kernel = _param(rngs.params(), (d, k, dh), ("embed", "kv_heads", "head_dim"), pd)
        self.o_kernel = _param(rngs.params(), (h, dh, d), ("heads", "head_dim", "embed"), pd)
        lora, cd = config.lora, config.dtype
        self.q_lora = adapter(lora, "q_proj", (d, h * dh), ("embed", "heads"), cd, lora_rngs)
        self.k_lora = adapter(lora, "k_proj", (d, k * dh), ("embed", "kv_heads"), cd, lora_rngs)
        self.v_lora = adapter(lora, "v_proj", (d, k * dh), ("embed", "kv_heads"), cd, lora_rngs)
        self.o_lora = adapter(lora, "o_proj", (h * dh, d), ("heads", "embed"), cd, lora_rngs)
        self.scaling = lora.scaling if lora is not None and lora.rank else 0.0
        if config.attention_bias:
            self.q_bias = _param(None, (h, dh), ("heads", "head_dim"), pd, init="zeros")
            self.k_bias = _param(None, (k, dh), ("kv_heads", "head_dim"), pd, init="zeros")
            self.v_bias = _param(None, (k, dh), ("kv_heads", "head_dim"), pd, init="zeros")
        if config.qk_norm:
            self.q_norm = RMSNorm(dh, **_norm_kwargs(config, "head_dim"))
            self.k_norm = RMSNorm(dh, **_norm_kwargs(config, "head_dim"))
        self.config = config
        # a scanned stack of interleaved local and global layers holds one Attention for every
        # layer: it reads its window and RoPE frequencies from per-layer tables at the scan's
        # (traced) layer index; otherwise both are this layer's, static
        self.per_layer = config.scan_layers and not config.uniform_layers
        self.rope_theta, self.rope_scaling = config.layer_rope(0 if self.per_layer else layer)
        window = None if self.per_layer else config.layer_window(layer)
        variant = dict(window=window, softcap=config.attn_logit_softcapping)
        if config.query_pre_attn_scalar is not None:
            variant["scale"] = config.attention_scale
        # the score variants this layer passes to attention (none: the plain program)
        self.variant = tuple((k, v) for k, v in sorted(variant.items()) if v is not None)

    def __call__(
        self,
        x_BTD: jax.Array,
        segment_ids_BT: jax.Array,
        positions_BT: jax.Array,
        cache: LayerKV | None = None,
        parent_ids_BT: jax.Array | None = None,
        layer: int | jax.Array | None = None,
    ) -> jax.Array | tuple[jax.Array, LayerKV]:
        """Attention output [B, T, D]; with a ``cache``, also the cache holding these keys.

        With a cache the T new keys/values are written at the cache's index and the queries
        attend to all L cached slots (this step's included) under the same visibility rule.
        ``parent_ids_BT`` (self-attention only): each token's parent segment, which it also
        sees (shared-prompt packing, ``attention/dense.py``); None: no parents. ``layer``: this
        layer's index (needed, traced, by a scanned stack of interleaved layers).
        """
        cfg, dt = self.config, x_BTD.dtype
        mm = cfg.matmul_dtype
        q_BTHDh = _project(x_BTD, _kernel(self.q_kernel, dt, mm), mm)
        k_BTKDh = _project(x_BTD, _kernel(self.k_kernel, dt, mm), mm)
        v_BTKDh = _project(x_BTD, _kernel(self.v_kernel, dt, mm), mm)
        q_BTHDh = adapt(q_BTHDh, self.q_lora, x_BTD, self.scaling)
        k_BTKDh = adapt(k_BTKDh, self.k_lora, x_BTD, self.scaling)
        v_BTKDh = adapt(v_BTKDh, self.v_lora, x_BTD, self.scaling)
        if cfg.attention_bias:
            q_BTHDh = q_BTHDh + weight(self.q_bias, dt)[None, None]
            k_BTKDh = k_BTKDh + weight(self.k_bias, dt)[None, None]
            v_BTKDh = v_BTKDh + weight(self.v_bias, dt)[None, None]
        if cfg.qk_norm:
            q_BTHDh, k_BTKDh = self.q_norm(q_BTHDh), self.k_norm(k_BTKDh)
        variant = dict(self.variant)
        if self.per_layer:
            if layer is None:
                raise ValueError("Attention: a scanned stack of interleaved layers needs `layer`")
            inv_freq, variant["window"] = _layer_tables(cfg)
            inv_freq, variant["window"] = inv_freq[layer], variant["window"][layer]
        else:
            scaling = self.rope_scaling.to_hf() if self.rope_scaling is not None else None
            inv_freq = rope_inv_freq(cfg.head_dim, self.rope_theta, scaling)
        q_BTHDh = apply_rope(q_BTHDh, positions_BT, inv_freq)
        k_BTKDh = apply_rope(k_BTKDh, positions_BT, inv_freq)
        attention = attention_fn(
            cfg.attention_impl, self_attention=cache is None, block_size=cfg.attention_block_size
        )
        if cache is None:
            parent = {} if parent_ids_BT is None else {"q_parent_BT": parent_ids_BT}
            out_BTHDh = attention(
                q_BTHDh,
                k_BTKDh,
                v_BTKDh,
                segment_ids_BT,
                segment_ids_BT,
                positions_BT,
                positions_BT,
                **parent,
                **variant,
            )
        else:  # the cache writes the new keys and attends (kv_cache.py, slot_kv_cache.py)
            if parent_ids_BT is not None:
                raise ValueError("Attention: parent_ids need self-attention, not a KV cache")
            out_BTHDh, cache = cache.attend(
                q_BTHDh, k_BTKDh, v_BTKDh, segment_ids_BT, positions_BT, attention, **variant
            )  # fmt: skip
        b, t, h, dh = out_BTHDh.shape
        o_kernel_HDhD = _kernel(self.o_kernel, dt, mm)
        out_BTHDh = out_BTHDh.reshape(b, t, h * dh)
        out_BTD = adapt(
            matmul(out_BTHDh, o_kernel_HDhD.reshape(h * dh, -1), mm),
            self.o_lora,
            out_BTHDh,
            self.scaling,
        )
        return out_BTD if cache is None else (out_BTD, cache)


NO_WINDOW = 1 << 30  # a global layer's entry in the window table: sees the whole document


def _layer_tables(config: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """Per-layer RoPE inverse frequencies ``[Nl, Dh/2]`` and windows ``[Nl]`` (``NO_WINDOW`` on
    global layers) of a scanned stack of interleaved layers."""
    inv_freq, windows = [], []
    for i in range(config.num_hidden_layers):
        theta, scaling = config.layer_rope(i)
        inv_freq.append(rope_inv_freq(config.head_dim, theta, scaling and scaling.to_hf()))
        windows.append(config.layer_window(i) or NO_WINDOW)
    return jnp.asarray(np.stack(inv_freq)), jnp.asarray(windows, jnp.int32)


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(x @ gate) * (x @ up))``; GeGLU with ``hidden_act:
    gelu_pytorch_tanh`` (Gemma: the tanh-approximate GELU in place of silu)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, lora_rngs: nnx.Rngs | None = None):
        d, f, pd = config.hidden_size, config.intermediate_size, config.param_dtype
        self.gate_kernel = _param(rngs.params(), (d, f), ("embed", "mlp"), pd)
        self.up_kernel = _param(rngs.params(), (d, f), ("embed", "mlp"), pd)
        self.down_kernel = _param(rngs.params(), (f, d), ("mlp", "embed"), pd)
        lora, cd = config.lora, config.dtype
        self.gate_lora = adapter(lora, "gate_proj", (d, f), ("embed", "mlp"), cd, lora_rngs)
        self.up_lora = adapter(lora, "up_proj", (d, f), ("embed", "mlp"), cd, lora_rngs)
        self.down_lora = adapter(lora, "down_proj", (f, d), ("mlp", "embed"), cd, lora_rngs)
        self.scaling = lora.scaling if lora is not None and lora.rank else 0.0
        self.operands = config.matmul_dtype  # matmul.py
        self.gelu = config.hidden_act == "gelu_pytorch_tanh"

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        dt, mm = x_BTD.dtype, self.operands
        gate_BTF = matmul(x_BTD, _kernel(self.gate_kernel, dt, mm), mm)
        up_BTF = matmul(x_BTD, _kernel(self.up_kernel, dt, mm), mm)
        gate_BTF = adapt(gate_BTF, self.gate_lora, x_BTD, self.scaling)
        up_BTF = adapt(up_BTF, self.up_lora, x_BTD, self.scaling)
        act = jax.nn.gelu(gate_BTF, approximate=True) if self.gelu else jax.nn.silu(gate_BTF)
        h_BTF = act * up_BTF
        down_BTD = matmul(h_BTF, _kernel(self.down_kernel, dt, mm), mm)
        return adapt(down_BTD, self.down_lora, h_BTF, self.scaling)


class Block(nnx.Module):
    """Pre-norm residual block: attention then MLP (the sparse ``MoE`` on Qwen3-MoE's MoE layers,
    ``ModelConfig.is_moe_layer``). Gemma also norms each sublayer's output before the residual
    add (``attn_out_norm``, ``mlp_out_norm``); ``post_attn_norm`` is always the MLP's input norm
    (HF's ``post_attention_layernorm`` in Llama, ``pre_feedforward_layernorm`` in Gemma)."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        rngs: nnx.Rngs,
        lora_rngs: nnx.Rngs | None = None,
        layer: int = 0,
    ):
        norm = _norm_kwargs(config, "embed")
        self.input_norm = RMSNorm(config.hidden_size, **norm)
        self.attn = Attention(config, rngs=rngs, lora_rngs=lora_rngs, layer=layer)
        self.post_attn_norm = RMSNorm(config.hidden_size, **norm)
        self.sandwich = config.model_type in GEMMA_TYPES
        if self.sandwich:
            self.attn_out_norm = RMSNorm(config.hidden_size, **norm)
            self.mlp_out_norm = RMSNorm(config.hidden_size, **norm)
        if config.is_moe_layer(layer):
            self.mlp = MoE(config, rngs=rngs, lora_rngs=lora_rngs)
        else:
            self.mlp = MLP(config, rngs=rngs, lora_rngs=lora_rngs)

    def __call__(
        self,
        x_BTD: jax.Array,
        segment_ids_BT: jax.Array,
        positions_BT: jax.Array,
        cache: LayerKV | None = None,
        parent_ids_BT: jax.Array | None = None,
        layer: int | jax.Array | None = None,
    ) -> jax.Array | tuple[jax.Array, LayerKV]:
        """Block output [B, T, D]; with a ``cache``, also the updated cache (see Attention;
        ``layer``: the block's index, which a scanned interleaved stack needs)."""
        x_norm = self.input_norm(x_BTD)
        if cache is None:
            attn_BTD = self.attn(x_norm, segment_ids_BT, positions_BT, None, parent_ids_BT, layer)
        else:
            attn_BTD, cache = self.attn(x_norm, segment_ids_BT, positions_BT, cache, None, layer)
        x_BTD = x_BTD + self._out(attn_BTD, "attn_out_norm")
        x_BTD = x_BTD + self._out(self._mlp(self.post_attn_norm(x_BTD))[0], "mlp_out_norm")
        return x_BTD if cache is None else (x_BTD, cache)

    def _out(self, y_BTD: jax.Array, norm: str) -> jax.Array:
        """A sublayer's output as added to the residual (Gemma: normed first)."""
        return getattr(self, norm)(y_BTD) if self.sandwich else y_BTD

    def routed(
        self,
        x_BTD: jax.Array,
        segment_ids_BT: jax.Array,
        positions_BT: jax.Array,
        cache: LayerKV | None,
        replay_BTK: jax.Array | None,
        parent_ids_BT: jax.Array | None = None,
    ) -> tuple[jax.Array, LayerKV | None, Any]:
        """``(output, cache, routing)``: the block with the MoE's ``Routing`` (None when dense);
        ``replay_BTK``: expert ids to use instead of the router's top-k (router replay);
        ``parent_ids_BT``: see :class:`Attention` (no cache)."""
        if cache is None:
            attn_BTD = self.attn(
                self.input_norm(x_BTD), segment_ids_BT, positions_BT, None, parent_ids_BT
            )
        else:
            attn_BTD, cache = self.attn(self.input_norm(x_BTD), segment_ids_BT, positions_BT, cache)
        x_BTD = x_BTD + self._out(attn_BTD, "attn_out_norm")
        y_BTD, routing = self._mlp(self.post_attn_norm(x_BTD), replay_BTK)
        return x_BTD + self._out(y_BTD, "mlp_out_norm"), cache, routing

    def _mlp(self, x_BTD: jax.Array, replay_BTK: jax.Array | None = None) -> tuple[jax.Array, Any]:
        if isinstance(self.mlp, MoE):
            return self.mlp(x_BTD, replay_BTK)
        return self.mlp(x_BTD), None


class Transformer(nnx.Module):
    """The language model: ``model(input_ids_BT, positions, segment_ids) -> logits_BTV``."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        pd = config.param_dtype
        self.embedding = _param(
            rngs.params(), (config.vocab_size, config.hidden_size), ("vocab", "vocab_embed"), pd
        )
        # created one by one in both layouts, so a seed gives the same weights scanned or not
        # (adapters draw from their own stream: a seed gives the same base with or without them)
        adapter_rngs = lora_rngs(rngs, config)
        blocks = [
            Block(config, rngs=rngs, lora_rngs=adapter_rngs, layer=i)
            for i in range(config.num_hidden_layers)
        ]
        self.layers = stack_blocks(blocks) if config.scan_layers else nnx.List(blocks)
        quantize_base(self.layers, config)  # QLoRA: the projections' kernels as int8 / nf4
        self.final_norm = RMSNorm(config.hidden_size, **_norm_kwargs(config, "embed"))
        if not config.tie_word_embeddings:
            self.lm_head = _param(
                rngs.params(), (config.hidden_size, config.vocab_size), ("vocab_embed", "vocab"), pd
            )
        self.config = config

    def hidden_states(
        self,
        input_ids_BT: jax.Array,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        parent_ids: jax.Array | None = None,
    ) -> jax.Array:
        """Final-normed hidden states [B, T, D] in the compute dtype (the LM head's input).

        ``segment_ids`` (1-based documents, 0 = padding) restrict attention to the same
        document; ``positions`` default to ``arange(T)`` without segments and otherwise restart
        at 0 for every document. Ids outside ``[0, V)`` are clamped, so padding may hold any id.
        ``parent_ids`` (int [B, T], 0 = none; needs ``segment_ids``): the segment each token
        also sees in full, under the position rule (shared-prompt packing: a completion's
        tokens see their prompt, laid out once per row; docs/attention.md). None runs exactly
        the program without it.
        """
        input_ids_BT, segment_ids_BT, positions_BT = _inputs(input_ids_BT, positions, segment_ids)
        extra = () if parent_ids is None else (_parents(parent_ids, input_ids_BT),)
        x_BTD = run_blocks(
            self.layers,
            lambda block, x_BTD, i, seg_BT, pos_BT, *par: block(
                x_BTD, seg_BT, pos_BT, None, *(par or (None,)), layer=i
            ),
            self._embed(input_ids_BT),
            segment_ids_BT,
            positions_BT,
            *extra,
            scanned=self.config.scan_layers,
            remat=self.config.remat,
        )
        return self.final_norm(x_BTD)

    def routed_hidden_states(
        self,
        input_ids_BT: jax.Array,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        replay_routes: jax.Array | None = None,
        parent_ids: jax.Array | None = None,
    ) -> tuple[jax.Array, MoeTrace]:
        """:meth:`hidden_states` of a MoE model and its routing (``moe/trace.py``): the expert
        ids every MoE layer chose for every token (``routes [B, T, Lm, K]``) and the Σ over MoE
        layers of the router softmax. ``replay_routes [B, T, Lm, K]``: use these expert ids
        instead of the router's top-k, with the router's probabilities gathered at them
        (router replay, docs/moe.md); the recorded routes are then these. ``parent_ids``: as in
        :meth:`hidden_states`."""
        if not self.config.moe_layers:
            raise ValueError("routed_hidden_states: the model has no MoE layer")
        input_ids_BT, segment_ids_BT, positions_BT = _inputs(input_ids_BT, positions, segment_ids)
        b, t = input_ids_BT.shape
        x_BTD, _, routes_LBTK, probs_BTE = run_blocks(
            self.layers,
            trace_step(self.config),
            (self._embed(input_ids_BT), None, *empty_trace(self.config, b, t)),
            segment_ids_BT,
            positions_BT,
            replay_layers(replay_routes),
            *(() if parent_ids is None else (_parents(parent_ids, input_ids_BT),)),
            scanned=self.config.scan_layers,
            remat=self.config.remat,
        )
        return self.final_norm(x_BTD), finish(routes_LBTK, probs_BTE)

    def _embed(self, input_ids_BT: jax.Array) -> jax.Array:
        """Embeddings in the compute dtype; ids outside ``[0, V)`` are clamped. Gemma scales
        them by ``sqrt(D)``, the factor rounded to the compute dtype as transformers does."""
        if is_marked(self.embedding):  # a ZeRO-3 shard: looked up without gathering the table
            x_BTD = fsdp.embed(self.embedding, input_ids_BT, self.config.dtype)
        else:
            x_BTD = jnp.take(self.embedding[...], input_ids_BT, axis=0, mode="clip").astype(
                self.config.dtype
            )
        if self.config.model_type in GEMMA_TYPES:
            x_BTD = x_BTD * jnp.asarray(self.config.hidden_size**0.5, x_BTD.dtype)
        return x_BTD

    def decode(
        self,
        input_ids_BT: jax.Array,
        positions_BT: jax.Array,
        segment_ids_BT: jax.Array,
        cache: KVCache | SlotKVCache,
        *,
        loop_layers: bool = False,
    ) -> tuple[jax.Array, KVCache | SlotKVCache]:
        """Run T new tokens against a KV cache: ``(hidden_BTD, cache)`` (``kv_cache.py``).

        The tokens' keys and values are written at slots ``[cache.index, cache.index + T)``
        and the queries attend to every cached slot under the training visibility rule, so a
        prefill (T = prompt length, empty cache) followed by T = 1 steps gives the hidden states
        of :meth:`hidden_states` on the whole sequence, up to float reduction order. The caller
        supplies positions and segment ids (nothing is inferred) and keeps the index within L.
        Apply :meth:`logits` to the positions it needs. ``loop_layers``: unrolled layers run in
        a loop that holds the block once (``layer_stack.run_blocks(looped=True)``: a short
        compile for a one-off pass such as a prefill).
        """
        hidden_BTD, cache, _ = self._decode(
            input_ids_BT, positions_BT, segment_ids_BT, cache, loop_layers=loop_layers
        )
        return hidden_BTD, cache

    def routed_decode(
        self,
        input_ids_BT: jax.Array,
        positions_BT: jax.Array,
        segment_ids_BT: jax.Array,
        cache: KVCache | SlotKVCache,
        *,
        loop_layers: bool = False,
    ) -> tuple[jax.Array, KVCache | SlotKVCache, jax.Array]:
        """:meth:`decode` of a MoE model and the expert ids its MoE layers chose for the new
        tokens, ``routes [B, T, Lm, K]`` int32 (what the rollout records for router replay)."""
        if not self.config.moe_layers:
            raise ValueError("routed_decode: the model has no MoE layer")
        return self._decode(
            input_ids_BT, positions_BT, segment_ids_BT, cache, routed=True, loop_layers=loop_layers
        )

    def _decode(
        self, input_ids_BT, positions_BT, segment_ids_BT, cache, routed=False, loop_layers=False
    ):
        input_ids_BT = jnp.asarray(input_ids_BT)
        if input_ids_BT.shape[1] > cache.length:
            raise ValueError(
                f"decode: {input_ids_BT.shape[1]} tokens do not fit a cache of {cache.length} slots"
            )
        segment_ids_BT, positions_BT = jnp.asarray(segment_ids_BT), jnp.asarray(positions_BT)
        cache = cache.write_entries(segment_ids_BT, positions_BT)
        advance = input_ids_BT.shape[1]
        if routed:
            b, t = input_ids_BT.shape
            x_BTD, cache, routes_LBTK, probs_BTE = run_blocks(
                self.layers,
                trace_step(self.config),
                (self._embed(input_ids_BT), cache, *empty_trace(self.config, b, t)),
                segment_ids_BT,
                positions_BT,
                None,
                scanned=self.config.scan_layers,
                looped=loop_layers,
                trace_once=True,  # the block traced once (layer_stack.run_blocks)
            )
            routes = finish(routes_LBTK, probs_BTE).routes_BTLK
            return self.final_norm(x_BTD), cache.advance(advance), routes

        def step(block, carry, i, seg_BT, pos_BT):
            x_BTD, cache = carry
            x_BTD, kv = block(x_BTD, seg_BT, pos_BT, cache.layer(i), layer=i)
            return x_BTD, cache.store(kv)

        x_BTD, cache = run_blocks(
            self.layers,
            step,
            (self._embed(input_ids_BT), cache),
            segment_ids_BT,
            positions_BT,
            scanned=self.config.scan_layers,
            looped=loop_layers,
            trace_once=True,  # the block traced once (layer_stack.run_blocks)
        )
        return self.final_norm(x_BTD), cache.advance(advance), None

    def head_kernel(self, dtype: jax.typing.DTypeLike | None = None) -> jax.Array:
        """LM head kernel [D, V] in ``dtype`` (None: the param dtype); the transposed embedding
        when tied. A ZeRO-3 shard is gathered here, in that dtype (``fsdp.py``)."""
        if self.config.tie_word_embeddings:
            return weight(self.embedding, dtype).T
        return weight(self.lm_head, dtype)

    def head_shard(self) -> tuple[jax.Array, str] | None:
        """``(kernel_DVl, axis)`` when the LM head is a ZeRO-3 shard of its vocabulary over the
        mesh axis ``axis`` (this rank's columns, param dtype; ``head.vocab_parallel_scores``);
        None otherwise."""
        if self.config.tie_word_embeddings:
            axis = fsdp.vocab_axis(self.embedding, -2)
            return None if axis is None else (self.embedding.get_value().T, axis)
        axis = fsdp.vocab_axis(self.lm_head, -1)
        return None if axis is None else (self.lm_head.get_value(), axis)

    def head_dtype(self, hidden_BTD: jax.Array) -> jax.typing.DTypeLike | None:
        """The dtype the LM head kernel is used in: its own (promoted to fp32 by the head) with
        ``fp32_lm_head``, else the hidden states' compute dtype."""
        return None if self.config.fp32_lm_head else hidden_BTD.dtype

    def __call__(
        self,
        input_ids_BT: jax.Array,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        parent_ids: jax.Array | None = None,
    ) -> jax.Array:
        """Logits [B, T, V]: float32 with ``fp32_lm_head``, else the compute dtype
        (``parent_ids``: see :meth:`hidden_states`)."""
        return self.logits(self.hidden_states(input_ids_BT, positions, segment_ids, parent_ids))

    def logits(self, hidden_BTD: jax.Array) -> jax.Array:
        """The LM head on final hidden states: fp32 with ``fp32_lm_head``, else compute dtype."""
        kernel_DV = self.head_kernel(self.head_dtype(hidden_BTD))
        return lm_head(
            hidden_BTD,
            kernel_DV,
            fp32=self.config.fp32_lm_head,
            softcap=self.config.final_logit_softcapping,
        )


def _parents(parent_ids_BT: jax.Array, input_ids_BT: jax.Array) -> jax.Array:
    """``parent_ids`` as int32 [B, T], checked against the ids' shape."""
    parent_ids_BT = jnp.asarray(parent_ids_BT)
    if parent_ids_BT.shape != input_ids_BT.shape:
        raise ValueError(
            f"parent_ids {parent_ids_BT.shape} must be [B, T] like input_ids {input_ids_BT.shape}"
        )
    return parent_ids_BT.astype(jnp.int32)


def _inputs(
    input_ids_BT: jax.Array, positions_BT: jax.Array | None, segment_ids_BT: jax.Array | None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Ids, segment ids and positions [B, T] (defaults of :meth:`Transformer.hidden_states`)."""
    input_ids_BT = jnp.asarray(input_ids_BT)
    if segment_ids_BT is None:
        segment_ids_BT = jnp.ones(input_ids_BT.shape, jnp.int32)
        if positions_BT is None:
            positions_BT = jnp.broadcast_to(
                jnp.arange(input_ids_BT.shape[1], dtype=jnp.int32), input_ids_BT.shape
            )
    elif positions_BT is None:
        positions_BT = positions_from_segments(segment_ids_BT)
    segment_ids_BT, positions_BT = jnp.asarray(segment_ids_BT), jnp.asarray(positions_BT)
    if segment_ids_BT.shape != input_ids_BT.shape or positions_BT.shape != input_ids_BT.shape:
        raise ValueError(
            f"input_ids {input_ids_BT.shape}, positions {positions_BT.shape} and segment_ids "
            f"{segment_ids_BT.shape} must all be [B, T]"
        )
    return input_ids_BT, segment_ids_BT, positions_BT
