"""Architecture and precision of a :class:`~jaxrl.models.transformer.Transformer`.

Field names follow transformers' ``config.json`` (``models/hf.py`` maps one to the other);
the run settings at the end (attention kernel, layer scan, remat) are never written to it.
No jax at import: the config layer reads the field names (``model.init`` keys) before jax loads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

ATTENTION_IMPLS = ("xla", "flash", "splash", "pallas_gpu", "auto")  # attention_dispatch.py
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma2", "gemma3")
QK_NORM_TYPES = ("qwen3", "qwen3_moe", "gemma3")  # model types with per-head q/k RMSNorm
# Gemma: (1 + w) RMSNorm, sqrt(D)-scaled embeddings, norms on the attention and MLP outputs
GEMMA_TYPES = ("gemma2", "gemma3")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # the gated MLP's activation (transformers' names)
FULL, SLIDING = "full_attention", "sliding_attention"  # transformers' layer_types
LAYER_TYPES = (FULL, SLIDING)
DTYPES = ("float32", "bfloat16", "float16")
# LoRA (models/lora.py): the projections an adapter may target, by their HF module names
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ALL_LINEAR = "all-linear"  # PEFT's shorthand: every projection above (never the LM head)
QUANTIZE_MODES = ("none", "int8", "nf4")  # the frozen base of QLoRA (models/adapters/quantize.py)


def _fail(field: str, value: Any, fix: str) -> None:
    raise ValueError(f"ModelConfig.{field}={value!r}: {fix}")


ROPE_TYPES = ("llama3", "linear")  # RopeScaling.rope_type
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """RoPE frequency scaling: Llama 3.1's (transformers' ``rope_type: "llama3"``) or linear
    position interpolation (``rope_type: "linear"``: every frequency divided by ``factor``;
    Gemma 3's global layers). The band fields are llama3's only."""

    rope_type: str = "llama3"  # "llama3" or "linear"
    factor: float  # divisor applied to (llama3: low) frequencies
    low_freq_factor: float | None = None  # wavelengths above original_max / low_freq_factor
    high_freq_factor: float | None = None  # wavelengths below original_max / high_freq_factor
    original_max_position_embeddings: int | None = None  # pretraining context length

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            _fail("rope_scaling.rope_type", self.rope_type, f"choose one of {ROPE_TYPES}")
        if self.factor <= 0:
            _fail("rope_scaling.factor", self.factor, "must be > 0")
        if self.rope_type == "linear":
            extra = [k for k in _LLAMA3_KEYS[1:] if getattr(self, k) is not None]
            if extra:
                _fail("rope_scaling", self.to_hf(), f"linear scaling takes no {extra}")
            return
        missing = [k for k in _LLAMA3_KEYS[1:] if getattr(self, k) is None]
        if missing:
            _fail("rope_scaling", self.to_hf(), f"llama3 scaling needs {missing}")
        if self.high_freq_factor <= self.low_freq_factor:
            _fail(
                "rope_scaling.high_freq_factor",
                self.high_freq_factor,
                f"must exceed low_freq_factor={self.low_freq_factor}",
            )
        if self.original_max_position_embeddings <= 0:
            _fail(
                "rope_scaling.original_max_position_embeddings",
                self.original_max_position_embeddings,
                "must be > 0",
            )

    @classmethod
    def from_hf(cls, scaling: Mapping[str, Any]) -> RopeScaling:
        """From a transformers ``rope_scaling`` / ``rope_parameters`` dict."""
        rope_type = scaling.get("rope_type", scaling.get("type"))
        if rope_type not in ROPE_TYPES:
            _fail("rope_scaling", dict(scaling), f"rope_type must be one of {ROPE_TYPES} (or None)")
        keys = _LLAMA3_KEYS if rope_type == "llama3" else _LLAMA3_KEYS[:1]
        missing = [k for k in keys if k not in scaling]
        if missing:
            _fail("rope_scaling", dict(scaling), f"{rope_type} scaling needs {missing}")
        return cls(rope_type=rope_type, **{k: scaling[k] for k in keys})

    def to_hf(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraSpec:
    """Low-rank adapters on the projections (PEFT's ``LoraConfig`` names; models/lora.py).

    ``y = W x + scaling * B (A x)`` with ``A [in, r]`` PEFT-initialised (kaiming-uniform) and
    ``B [r, out]`` zero, so a fresh adapter leaves the model unchanged; ``scaling`` is
    ``alpha / r`` (``alpha / sqrt(r)`` with rsLoRA). ``rank == 0``: no adapters (with
    ``quantize`` set, the quantised base alone: the reference model of a QLoRA run).
    """

    rank: int = 0  # r; 0 = no adapters
    alpha: float = 16.0  # scaling numerator
    dropout: float = 0.0  # only 0 (see jaxrl.config.run.LoraSection)
    target_modules: tuple[str, ...] = LORA_TARGETS  # HF projection names
    use_rslora: bool = False  # scaling alpha / sqrt(r) instead of alpha / r
    quantize: str = "none"  # frozen base kernels: none, int8 (per channel) or nf4 (blocks of 64)

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 0:
            _fail("lora.rank", self.rank, "must be an int >= 0")
        unknown = [t for t in self.target_modules if t not in LORA_TARGETS]
        if unknown or not self.target_modules:
            _fail("lora.target_modules", self.target_modules, f"choose from {LORA_TARGETS}")
        ordered = tuple(t for t in LORA_TARGETS if t in self.target_modules)  # one canonical order
        object.__setattr__(self, "target_modules", ordered)
        if self.quantize not in QUANTIZE_MODES:
            _fail("lora.quantize", self.quantize, f"choose one of {QUANTIZE_MODES}")
        if self.dropout != 0.0:
            _fail("lora.dropout", self.dropout, "only 0.0 is supported")

    @property
    def scaling(self) -> float:
        """The factor on the adapter's output: ``alpha / r``, or ``alpha / sqrt(r)`` (rsLoRA)."""
        return self.alpha / (self.rank**0.5 if self.use_rslora else self.rank)

    def targets(self, name: str) -> bool:
        """Whether the projection ``name`` (an HF name, e.g. ``q_proj``) carries an adapter."""
        return self.rank > 0 and name in self.target_modules


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Architecture and precision of a :class:`Transformer` (names follow transformers)."""

    model_type: str  # one of MODEL_TYPES (llama, mistral, qwen2, qwen3, qwen3_moe, gemma2/3)
    vocab_size: int  # V
    hidden_size: int  # D
    intermediate_size: int  # F, SwiGLU hidden width
    num_hidden_layers: int  # number of blocks
    num_attention_heads: int  # H
    num_key_value_heads: int  # K, divides H (GQA)
    head_dim: int | None = None  # Dh; None means hidden_size // num_attention_heads
    rope_theta: float = 10000.0  # RoPE base
    rope_scaling: RopeScaling | Mapping[str, Any] | None = None  # None, llama3 or linear (dict ok)
    rms_norm_eps: float = 1e-6  # RMSNorm epsilon
    tie_word_embeddings: bool = False  # LM head kernel is the transposed embedding
    attention_bias: bool = False  # q/k/v biases (Qwen2: always True; others: False)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3: always True)
    max_position_embeddings: int = 4096  # longest position the model was trained for
    hidden_act: str = "silu"  # gated MLP activation: silu (SwiGLU) or gelu_pytorch_tanh (GeGLU)
    query_pre_attn_scalar: float | None = None  # scores scaled by its -1/2 power; None: head_dim
    attn_logit_softcapping: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    sliding_window: int | None = None  # a local layer's query sees keys q_pos - k_pos < window
    layer_types: tuple[str, ...] | None = None  # per layer, LAYER_TYPES; None: all full
    rope_local_base_freq: float | None = None  # RoPE base of local layers (Gemma 3); None: theta
    param_dtype: str = "float32"  # storage dtype of parameters
    dtype: str | None = None  # compute dtype; None means param_dtype
    matmul_dtype: str | None = None  # operands of the projection matmuls (matmul.py); None:
    # the compute dtype. "bfloat16" under fp32 compute: bf16 operands, fp32 accumulation
    fp32_lm_head: bool = False  # fp32 x fp32 HIGHEST logits (docs/algorithms/accumulation.md §5)
    # Mixture of experts (qwen3_moe only; models/moe/, docs/moe.md), transformers' names:
    num_experts: int = 0  # E routed experts per MoE layer (0: dense model)
    num_experts_per_tok: int = 0  # top-k experts per token
    moe_intermediate_size: int = 0  # SwiGLU hidden width of one expert
    norm_topk_prob: bool = False  # renormalise the top-k router probabilities to sum to 1
    decoder_sparse_step: int = 1  # layer i is MoE iff (i + 1) % step == 0 (and not mlp_only)
    mlp_only_layers: tuple[int, ...] = ()  # layers kept dense (intermediate_size MLP)
    router_aux_loss_coef: float = 0.0  # load-balance loss weight (0: off; losses/load_balance.py)
    # Run settings, not architecture (never written to config.json):
    attention_impl: str = "auto"  # xla, flash, splash, pallas_gpu or auto (attention.py)
    attention_block_size: int = 128  # query/key block of flash and the Pallas kernels
    scan_layers: bool = False  # layer parameters stacked [Nl, ...] and run by one lax.scan
    remat: str = "none"  # "none", "block" or a jax.checkpoint_policies name (layer_stack.py)
    lora: LoraSpec | None = None  # low-rank adapters / quantised base (models/lora.py)

    def __post_init__(self) -> None:
        if self.model_type not in MODEL_TYPES:
            _fail("model_type", self.model_type, f"choose one of {MODEL_TYPES}")
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                _fail(name, value, "must be a positive int")
        if self.num_attention_heads % self.num_key_value_heads:
            _fail(
                "num_key_value_heads",
                self.num_key_value_heads,
                f"must divide num_attention_heads={self.num_attention_heads}",
            )
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                _fail("head_dim", None, "set it: hidden_size is not divisible by the head count")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if not isinstance(self.head_dim, int) or self.head_dim <= 0 or self.head_dim % 2:
            _fail("head_dim", self.head_dim, "must be a positive even int (RoPE rotates pairs)")
        if self.rope_theta <= 0:
            _fail("rope_theta", self.rope_theta, "must be > 0")
        if isinstance(self.rope_scaling, Mapping):
            object.__setattr__(self, "rope_scaling", RopeScaling.from_hf(self.rope_scaling))
        if self.rms_norm_eps <= 0:
            _fail("rms_norm_eps", self.rms_norm_eps, "must be > 0")
        self._check_attention_variants()
        if self.attention_bias != (self.model_type == "qwen2"):
            _fail(
                "attention_bias",
                self.attention_bias,
                f"{self.model_type} has q/k/v biases iff it is qwen2; "
                f"set attention_bias={self.model_type == 'qwen2'}",
            )
        if self.qk_norm != (self.model_type in QK_NORM_TYPES):
            _fail(
                "qk_norm",
                self.qk_norm,
                f"{self.model_type} has q/k norms iff it is one of {QK_NORM_TYPES}; "
                f"set qk_norm={self.model_type in QK_NORM_TYPES}",
            )
        self._check_moe()
        if self.param_dtype not in DTYPES:
            _fail("param_dtype", self.param_dtype, f"choose one of {DTYPES}")
        if self.dtype is None:
            object.__setattr__(self, "dtype", self.param_dtype)
        if self.dtype not in DTYPES:
            _fail("dtype", self.dtype, f"choose one of {DTYPES} or None (= param_dtype)")
        if self.matmul_dtype not in (None, *DTYPES):
            _fail("matmul_dtype", self.matmul_dtype, f"choose one of {DTYPES} or None (= dtype)")
        if self.matmul_dtype == self.dtype:
            object.__setattr__(self, "matmul_dtype", None)  # one program for the same math
        if self.attention_impl not in ATTENTION_IMPLS:
            _fail("attention_impl", self.attention_impl, f"choose one of {ATTENTION_IMPLS}")
        if not isinstance(self.attention_block_size, int) or self.attention_block_size < 1:
            _fail("attention_block_size", self.attention_block_size, "must be a positive int")
        if isinstance(self.lora, Mapping):
            object.__setattr__(self, "lora", LoraSpec(**self.lora))
        if self.lora is not None and self.lora.rank == 0 and self.lora.quantize == "none":
            object.__setattr__(self, "lora", None)  # nothing to adapt: the plain model
        if not isinstance(self.scan_layers, bool):
            _fail("scan_layers", self.scan_layers, "use true or false")
        from jaxrl.models.layer_stack import check_remat  # imports jax: only when building one

        check_remat(self.remat, "ModelConfig.remat")

    def _check_attention_variants(self) -> None:
        """Activation, score scale, soft-caps, sliding window and per-layer types."""
        if self.hidden_act not in ACTIVATIONS:
            _fail("hidden_act", self.hidden_act, f"choose one of {ACTIVATIONS}")
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not value > 0):
                _fail(name, value, "must be > 0 or None (off)")
        if self.rope_local_base_freq is not None and not self.rope_local_base_freq > 0:
            _fail("rope_local_base_freq", self.rope_local_base_freq, "must be > 0 or None")
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
            if len(self.layer_types) != self.num_hidden_layers:
                _fail(
                    "layer_types",
                    self.layer_types,
                    f"needs one entry per layer (num_hidden_layers={self.num_hidden_layers})",
                )
            bad = sorted({t for t in self.layer_types if t not in LAYER_TYPES})
            if bad:
                _fail("layer_types", bad, f"entries must be one of {LAYER_TYPES}")
            if SLIDING not in self.layer_types:
                object.__setattr__(self, "layer_types", None)  # all full: the plain model
        window = self.sliding_window
        if window is not None and (not isinstance(window, int) or isinstance(window, bool)):
            _fail("sliding_window", window, "must be a positive int or None")
        if window is not None and window <= 0:
            _fail("sliding_window", window, "must be a positive int or None")
        if self.layer_types is not None and window is None:
            _fail("sliding_window", None, f"layer_types has {SLIDING} layers: set the window")
        if self.layer_types is None and window is not None:
            object.__setattr__(self, "layer_types", (SLIDING,) * self.num_hidden_layers)
        gemma = self.model_type in GEMMA_TYPES
        if gemma and self.hidden_act != "gelu_pytorch_tanh":
            _fail("hidden_act", self.hidden_act, f"{self.model_type} uses gelu_pytorch_tanh")
        if not gemma:
            for name in ("query_pre_attn_scalar", "attn_logit_softcapping",
                         "final_logit_softcapping", "rope_local_base_freq"):  # fmt: skip
                if getattr(self, name) is not None:
                    _fail(name, getattr(self, name), f"only gemma2/gemma3 have it, not "
                          f"{self.model_type}; leave it None")  # fmt: skip

    def layer_window(self, i: int) -> int | None:
        """Layer ``i``'s sliding window (None: a global layer, attends to the whole document)."""
        if self.layer_types is None or self.layer_types[i] != SLIDING:
            return None
        return self.sliding_window

    def layer_rope(self, i: int) -> tuple[float, RopeScaling | None]:
        """Layer ``i``'s RoPE ``(base, scaling)``: Gemma 3's local layers use
        ``rope_local_base_freq`` unscaled, every other layer ``rope_theta`` and ``rope_scaling``."""
        if self.rope_local_base_freq is not None and self.layer_window(i) is not None:
            return self.rope_local_base_freq, None
        return self.rope_theta, self.rope_scaling  # type: ignore[return-value]

    @property
    def uniform_layers(self) -> bool:
        """Whether every layer has the same window and RoPE (a scanned stack of interleaved
        local and global layers reads them per layer from tables: ``transformer.Attention``)."""
        kinds = {(self.layer_window(i), self.layer_rope(i)) for i in range(self.num_hidden_layers)}
        return len(kinds) == 1

    @property
    def attention_scale(self) -> float:
        """The factor on ``q . k``: ``query_pre_attn_scalar ** -0.5`` (default ``head_dim``)."""
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def _check_moe(self) -> None:
        """The MoE fields: all set for qwen3_moe, all left at their defaults otherwise."""
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))
        if self.model_type != "qwen3_moe":
            if self.num_experts:
                _fail("num_experts", self.num_experts, "only model_type qwen3_moe has experts")
            return
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                _fail(name, value, "must be a positive int for qwen3_moe")
        if self.num_experts_per_tok > self.num_experts:
            _fail(
                "num_experts_per_tok",
                self.num_experts_per_tok,
                f"must be <= num_experts={self.num_experts}",
            )
        if not isinstance(self.decoder_sparse_step, int) or self.decoder_sparse_step < 1:
            _fail("decoder_sparse_step", self.decoder_sparse_step, "must be an int >= 1")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            _fail("mlp_only_layers", self.mlp_only_layers, f"{bad} are not layer indices")
        if self.router_aux_loss_coef < 0:
            _fail("router_aux_loss_coef", self.router_aux_loss_coef, "must be >= 0 (0: off)")
        kinds = {self.is_moe_layer(i) for i in range(self.num_hidden_layers)}
        if self.scan_layers and len(kinds) > 1:
            _fail(
                "scan_layers",
                True,
                "a scanned stack needs every layer alike: with decoder_sparse_step="
                f"{self.decoder_sparse_step} and mlp_only_layers={list(self.mlp_only_layers)} some "
                "layers are dense and some MoE; set scan_layers: false",
            )

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer ``i`` is a sparse MoE block (transformers' Qwen3MoeDecoderLayer rule)."""
        return (
            self.num_experts > 0
            and i not in self.mlp_only_layers
            and (i + 1) % self.decoder_sparse_step == 0
        )

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The indices of the MoE layers, in order (empty for a dense model)."""
        return tuple(i for i in range(self.num_hidden_layers) if self.is_moe_layer(i))

    @classmethod
    def tiny(cls, vocab_size: int, **overrides: Any) -> ModelConfig:
        """A small model trained from scratch on CPU: D=128, 4 layers, H=4, K=2, F=384."""
        model_type = overrides.get("model_type", "llama")
        fields: dict[str, Any] = dict(
            model_type=model_type,
            vocab_size=vocab_size,
            hidden_size=128,
            intermediate_size=384,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=2048,
            attention_bias=model_type == "qwen2",
            qk_norm=model_type in QK_NORM_TYPES,
            tie_word_embeddings=True,
        )
        if model_type in GEMMA_TYPES:
            fields["hidden_act"] = "gelu_pytorch_tanh"
        fields.update(overrides)
        return cls(**fields)
