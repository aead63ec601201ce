"""``model``: which model a run trains (a HF directory or hub id, or a fresh shape), its
precision, kernels and LoRA adapters (``model.lora``)."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from jaxrl.config.base import ConfigError, require, suggest
from jaxrl.models.model_config import (
    ALL_LINEAR,
    ATTENTION_IMPLS,
    LORA_TARGETS,
    QUANTIZE_MODES,
    LoraSpec,
    ModelConfig,
)

__all__ = ["MODEL_INIT_KEYS", "MODEL_SECTION_KEYS", "LoraSection", "ModelSection"]

MODEL_SECTION_KEYS = (
    "param_dtype",
    "dtype",
    "matmul_dtype",
    "fp32_lm_head",
    "attention_impl",
    "attention_block_size",
    "scan_layers",
    "remat",
    "lora",
)
# ``model.init`` keys: ModelConfig's architecture fields (the rest are model.<key> settings)
MODEL_INIT_KEYS = tuple(
    f.name for f in dataclasses.fields(ModelConfig) if f.name not in MODEL_SECTION_KEYS
)

AttentionImpl = Literal[ATTENTION_IMPLS]  # docs/attention.md


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraSection:
    """Low-rank adapters (LoRA / rsLoRA / QLoRA, docs/lora.md): only the adapters are trained,
    optimised and checkpointed; the base is frozen in the compute dtype (quantised with
    ``quantize``) and is the reference of DPO / GRPO with beta > 0. ``rank: 0`` = off."""

    rank: int = 0  # adapter rank r; 0 = full fine-tuning (no adapters)
    alpha: float = 16.0  # adapter output scaled by alpha / rank (alpha / sqrt(rank) with rsLoRA)
    dropout: float = 0.0  # PEFT's lora_dropout; only 0.0 (a random mask per micro-batch
    # would make the update depend on the micro-batching)
    target_modules: str | list[str] = ALL_LINEAR  # "all-linear" or HF projection names:
    # q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj
    use_rslora: bool = False  # rank-stabilised scaling alpha / sqrt(rank)
    quantize: Literal[QUANTIZE_MODES] = "none"  # frozen base projections: none, int8 or nf4
    # (QLoRA); needs rank > 0
    adapter_path: str | None = None  # a PEFT adapter directory (adapter_config.json +
    # adapter_model.safetensors) whose weights start the adapters; its rank and targets are used

    def __post_init__(self):
        require(
            isinstance(self.rank, int) and self.rank >= 0,
            "model.lora.rank",
            self.rank,
            "use 0 (no adapters) or a positive rank such as 8 or 16",
        )
        require(self.alpha > 0, "model.lora.alpha", self.alpha, "use a positive alpha, e.g. 16")
        require(
            self.dropout == 0.0,
            "model.lora.dropout",
            self.dropout,
            "only 0.0 is supported: a dropout mask drawn per micro-batch would make the update "
            "depend on how the batch is cut into micro-batches; leave it at 0",
        )
        targets = self.targets
        unknown = [t for t in targets if t not in LORA_TARGETS]
        require(
            bool(targets) and not unknown,
            "model.lora.target_modules",
            self.target_modules,
            f"use {ALL_LINEAR!r} or a list of {', '.join(LORA_TARGETS)}",
        )
        require(
            self.quantize == "none" or self.rank > 0 or self.adapter_path is not None,
            "model.lora.quantize",
            self.quantize,
            "a quantised base is frozen, so it needs adapters to train: set model.lora.rank",
        )

    @property
    def enabled(self) -> bool:
        """Whether the run trains adapters (a rank or an adapter directory is given)."""
        return self.rank > 0 or self.adapter_path is not None

    @property
    def targets(self) -> tuple[str, ...]:
        """The targeted projections' HF names (``all-linear``: all seven)."""
        if isinstance(self.target_modules, str):
            return LORA_TARGETS if self.target_modules == ALL_LINEAR else (self.target_modules,)
        return tuple(self.target_modules)

    def spec(self) -> LoraSpec | None:
        """The model's ``LoraSpec`` (None without a rank; an ``adapter_path``'s rank and
        targets are read when the model is built)."""
        if self.rank == 0:
            return None
        return LoraSpec(
            rank=self.rank,
            alpha=float(self.alpha),
            target_modules=self.targets,
            use_rslora=self.use_rslora,
            quantize=self.quantize,
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSection:
    """Which model to train: a local HF directory or a Hugging Face hub id, or a fresh model of
    the given shape."""

    path: str | None = None  # a local HF checkpoint directory, or a hub id (org/name[@revision],
    # not a local path: downloaded into the hub cache, HF_HOME / HF_HUB_OFFLINE honoured, when
    # the run starts); None = initialise from `init`
    init: dict[str, Any] = dataclasses.field(default_factory=dict)  # ModelConfig.tiny overrides
    param_dtype: Literal["float32", "bfloat16"] = "float32"  # master weights: what AdamW
    # updates and checkpoints store; bfloat16 needs optimizer.master_rounding (docs/precision.md)
    dtype: Literal["float32", "bfloat16", "auto"] | None = None  # compute dtype of the forward,
    # the sampler and the scorer; None = param_dtype; auto = the backend's fast dtype: bfloat16
    # on GPU/TPU, float32 where bf16 arithmetic is emulated (CPU) (docs/precision.md)
    matmul_dtype: Literal["float32", "bfloat16", "auto"] | None = None  # operands of the
    # projection matmuls (fp32 accumulation); None = the compute dtype, or auto when dtype is
    # auto; auto = bfloat16 under fp32 compute on a CPU with AMX-BF16 or AVX512-BF16
    # (docs/precision.md)
    fp32_lm_head: bool = False  # logits in fp32 from (possibly bf16) hidden and weights
    logprob_chunk: int = 0  # token chunk for log-probs (0 = auto: whole rows unless a chunk's
    # logits would exceed 128M values, as with a 150k vocabulary on rows over 512 tokens)
    attention_impl: AttentionImpl = "auto"  # attention kernel; auto = best for the backend
    attention_block_size: int = 128  # query/key block of flash and the Pallas kernels
    scan_layers: bool = False  # stack the layers' parameters and run them with one lax.scan
    remat: str = "none"  # recompute in backward: "none", "block" or a jax.checkpoint_policies name
    lora: LoraSection = dataclasses.field(default_factory=LoraSection)  # adapters (docs/lora.md)

    def __post_init__(self):
        for key in self.init:
            if key in MODEL_SECTION_KEYS:
                raise ConfigError(
                    f"model.init.{key} is set by model.{key}: move it out of model.init"
                )
            if key not in MODEL_INIT_KEYS:
                raise ConfigError(
                    f"unknown config key 'model.init.{key}': {suggest(str(key), MODEL_INIT_KEYS)}"
                )
        require(
            self.attention_block_size >= 1,
            "model.attention_block_size",
            self.attention_block_size,
            "use a positive block size (tokens), e.g. 128",
        )
        require(
            self.logprob_chunk >= 0,
            "model.logprob_chunk",
            self.logprob_chunk,
            "use 0 (no chunking) or a positive chunk size",
        )
        if self.remat not in ("none", "block"):  # a policy name: checked against jax's list
            from jaxrl.models.layer_stack import check_remat

            try:
                check_remat(self.remat, "model.remat")
            except ValueError as e:
                raise ConfigError(str(e)) from None
