"""Hugging Face checkpoints in and out: local safetensors directories, numpy only, no network.

Tensor names map one to one onto the :class:`Transformer` state; HF ``nn.Linear`` weights are
``[out, in]`` and become ``[in, ...out]`` kernels (``q_proj.weight [H*Dh, D]`` ->
``q_kernel [D, H, Dh]``, ``o_proj.weight [D, H*Dh]`` -> ``o_kernel [H, Dh, D]``). A model with
``scan_layers`` stacks the per-layer tensors ``model.layers.{i}.*`` on a leading layer axis
(``layers.attn.q_kernel [Nl, D, H, Dh]``): on load each layer's tensor is written into its slot
of the stacked device buffer, on save each slot is written back as its own tensor, so the
files are the same in both layouts.

Gemma (docs/models.md): ``Gemma2ForCausalLM``, ``Gemma3ForCausalLM`` and the text tower of a
``Gemma3ForConditionalGeneration`` checkpoint (its ``text_config`` and the
``model.language_model.*`` / ``language_model.model.*`` tensors; the vision tower is not
read). A Gemma 3 model is written back as ``Gemma3ForCausalLM``. Sliding-window configs
(Mistral's ``sliding_window``, Qwen's ``use_sliding_window`` / ``max_window_layers``,
``layer_types``) load with their windows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxrl.models.model_config import (
    FULL,
    GEMMA_TYPES,
    QK_NORM_TYPES,
    SLIDING,
    ModelConfig,
    RopeScaling,
)
from jaxrl.models.sharding import state_shardings
from jaxrl.models.transformer import Transformer
from jaxrl.runtime import storage
from jaxrl.runtime.mesh import is_primary, to_host

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",  # its text tower (module doc)
}
MULTIMODAL = "Gemma3ForConditionalGeneration"
_ARCH_OF = {m: a for a, m in ARCHITECTURES.items() if a != MULTIMODAL}
# transformers' model_type (config.json) of each jaxrl model_type, where they differ
HF_MODEL_TYPE = {"gemma3": "gemma3_text"}
_FROM_HF_TYPE = {"gemma3_text": "gemma3", **{m: m for m in _ARCH_OF if m not in HF_MODEL_TYPE}}
# where the text tower of a multimodal checkpoint keeps its tensors (transformers v5, v4)
_TOWER_PREFIXES = ("model.language_model.", "language_model.model.")
_TOWER_IGNORED = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.",
                  "multi_modal_projector.", "language_model.lm_head.")  # fmt: skip
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# transformers' Gemma2Config / Gemma3TextConfig defaults: real checkpoints' config.json (the
# text_config of multimodal Gemma 3 ones above all) leave many fields at them
_GEMMA_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": dict(
        vocab_size=256_000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=8192,
        rms_norm_eps=1e-6, query_pre_attn_scalar=256, sliding_window=4096,
        final_logit_softcapping=30.0, attn_logit_softcapping=50.0, tie_word_embeddings=True,
    ),
    "gemma3": dict(
        vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256,
        max_position_embeddings=131_072, rms_norm_eps=1e-6, query_pre_attn_scalar=256,
        sliding_window=4096,
        sliding_window_pattern=6, final_logit_softcapping=None, attn_logit_softcapping=None,
        tie_word_embeddings=True,
    ),
}  # fmt: skip
SAVE_DTYPES = ("float32", "bfloat16", "float16")  # dtypes save_pretrained writes
# the special token ids transformers keeps in both config.json and generation_config.json
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def config_from_hf(hf: Mapping[str, Any], **settings: Any) -> ModelConfig:
    """ModelConfig from a transformers ``config.json`` dict (v4 or v5 rope format); ``settings``
    are jaxrl's run settings, which config.json does not hold: ``ModelConfig``'s precision,
    attention kernel and layer stack fields (``param_dtype``, ``dtype``, ``fp32_lm_head``,
    ``attention_impl``, ``attention_block_size``, ``scan_layers``, ``remat``), its defaults
    where left out."""
    archs = list(hf.get("architectures") or [])
    model_type = hf.get("model_type")
    known = [a for a in archs if a in ARCHITECTURES]
    if known:
        model_type = ARCHITECTURES[known[0]]
    elif not archs and model_type == "gemma3" and isinstance(hf.get("text_config"), Mapping):
        known = [MULTIMODAL]
    elif archs or model_type not in _FROM_HF_TYPE:
        raise ValueError(
            f"unsupported architecture {archs or model_type!r}: jaxrl supports "
            f"{sorted(ARCHITECTURES)} (model_type {sorted(_FROM_HF_TYPE)})"
        )
    else:
        model_type = _FROM_HF_TYPE[model_type]
    if known and known[0] == MULTIMODAL:  # the text tower's config, the top level's tying
        text = hf.get("text_config")
        if not isinstance(text, Mapping):
            raise ValueError(f"{MULTIMODAL} config.json without a text_config: re-save it")
        hf = {"tie_word_embeddings": hf.get("tie_word_embeddings", True), **text}
    if model_type in GEMMA_TYPES:
        hf = {**_GEMMA_DEFAULTS[model_type], **hf}
    act = hf.get("hidden_activation") if model_type in GEMMA_TYPES else None
    act = (
        act
        or hf.get("hidden_act")
        or ("gelu_pytorch_tanh" if model_type in GEMMA_TYPES else "silu")
    )
    if act not in ("silu", "gelu_pytorch_tanh"):
        raise ValueError(
            f"unsupported hidden_act={act!r}: jaxrl's gated MLP takes 'silu' (SwiGLU) or "
            "'gelu_pytorch_tanh' (GeGLU)"
        )
    if hf.get("mlp_bias"):
        raise ValueError("unsupported mlp_bias=True: jaxrl MLPs have no biases")
    if model_type != "qwen2" and hf.get("attention_bias"):
        raise ValueError(
            f"unsupported attention_bias=True for {model_type}: it adds an o_proj bias "
            "that jaxrl does not model"
        )
    if hf.get("use_bidirectional_attention"):
        raise ValueError("unsupported use_bidirectional_attention=True: jaxrl is causal")
    rope = dict(hf.get("rope_parameters") or {})
    local_theta = hf.get("rope_local_base_freq")
    if rope and all(isinstance(v, Mapping) for v in rope.values()):  # per layer type (Gemma 3)
        if model_type != "gemma3" or set(rope) - {FULL, SLIDING}:
            raise ValueError(f"unsupported per-layer rope_parameters {sorted(rope)}")
        local = dict(rope.get(SLIDING) or {})
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"unsupported rope_parameters[{SLIDING!r}]={local}: only default")
        local_theta = local.get("rope_theta", local_theta)
        rope = dict(rope.get(FULL) or {})
    scaling = dict(hf.get("rope_scaling") or rope)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ("default", "llama3", "linear"):
        raise ValueError(
            f"unsupported rope_type={rope_type!r}: jaxrl supports default, llama3 and linear"
        )
    if rope_type == "llama3":  # as transformers' standardize_rope_params
        scaling.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings"))
    heads = hf["num_attention_heads"]
    gemma: dict[str, Any] = {}
    if model_type in GEMMA_TYPES:
        gemma = dict(
            query_pre_attn_scalar=float(hf["query_pre_attn_scalar"]),
            attn_logit_softcapping=hf.get("attn_logit_softcapping"),
            final_logit_softcapping=hf.get("final_logit_softcapping"),
        )
        if model_type == "gemma3":
            gemma["rope_local_base_freq"] = float(local_theta or 10_000.0)
    moe: dict[str, Any] = {}
    if model_type == "qwen3_moe":
        moe = dict(
            num_experts=hf.get("num_experts") or hf.get("num_local_experts"),
            num_experts_per_tok=hf["num_experts_per_tok"],
            moe_intermediate_size=hf["moe_intermediate_size"],
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            decoder_sparse_step=int(hf.get("decoder_sparse_step") or 1),
            mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
            # transformers adds the load-balance loss only with output_router_logits
            router_aux_loss_coef=float(hf.get("router_aux_loss_coef") or 0.0)
            if hf.get("output_router_logits")
            else 0.0,
        )
    return ModelConfig(
        model_type=model_type,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_hidden_layers=hf["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rope_theta=float(
            hf.get("rope_theta")
            or rope.get("rope_theta")
            or (1_000_000.0 if model_type == "gemma3" else 10000.0)
        ),
        rope_scaling=RopeScaling.from_hf(scaling) if rope_type != "default" else None,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=model_type == "qwen2",
        qk_norm=model_type in QK_NORM_TYPES,
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        hidden_act=act,
        **_windows(hf, model_type),
        **gemma,
        **moe,
        **settings,
    )


def _windows(hf: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """``sliding_window`` and ``layer_types`` as transformers reads them for ``model_type``:
    Mistral's window on every layer, Qwen's behind ``use_sliding_window`` from layer
    ``max_window_layers`` on (Qwen3-MoE: every layer), Gemma 2's on every other layer and
    Gemma 3's on 5 of every ``sliding_window_pattern`` (6) layers; an explicit
    ``layer_types`` list wins where transformers reads one."""
    n, window = hf["num_hidden_layers"], hf.get("sliding_window")
    if model_type == "llama" or window is None:
        return {}
    if model_type in ("qwen2", "qwen3", "qwen3_moe") and not hf.get("use_sliding_window"):
        return {}  # transformers sets sliding_window = None then
    types = hf.get("layer_types") if model_type != "mistral" else None
    if model_type == "qwen3_moe":
        types = None
    if types is None:
        if model_type in ("qwen2", "qwen3"):
            start = hf.get("max_window_layers", 28)
            types = [SLIDING if i >= start else FULL for i in range(n)]
        elif model_type == "gemma2":
            types = [SLIDING if (i + 1) % 2 else FULL for i in range(n)]
        elif model_type == "gemma3":
            pattern = int(hf.get("sliding_window_pattern") or 6)
            types = [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
        else:  # mistral, qwen3_moe: every layer
            types = [SLIDING] * n
    return dict(sliding_window=int(window), layer_types=tuple(types))


def config_to_hf(config: ModelConfig, *, dtype: str | None = None) -> dict[str, Any]:
    """transformers ``config.json`` dict (legacy ``rope_theta``/``rope_scaling`` keys); run
    settings (dtypes aside from ``torch_dtype``, ``attention_impl``) are not written.
    ``dtype``: the dtype of the written tensors (``torch_dtype``); None = ``param_dtype``."""
    hf: dict[str, Any] = {
        "architectures": [_ARCH_OF[config.model_type]],
        "model_type": HF_MODEL_TYPE.get(config.model_type, config.model_type),
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": config.hidden_act,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling.to_hf() if config.rope_scaling else None,
        "tie_word_embeddings": config.tie_word_embeddings,
        "torch_dtype": dtype or config.param_dtype,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
    }
    types = list(config.layer_types) if config.layer_types is not None else None
    if config.model_type == "llama":
        hf.update(attention_bias=False, mlp_bias=False)
    elif config.model_type in GEMMA_TYPES or config.model_type == "mistral":
        hf.update(attention_bias=False, sliding_window=config.sliding_window)
        if config.model_type in GEMMA_TYPES:
            hf.update(
                hidden_activation=config.hidden_act,
                query_pre_attn_scalar=_int_if_whole(config.query_pre_attn_scalar),
                attn_logit_softcapping=config.attn_logit_softcapping,
                final_logit_softcapping=config.final_logit_softcapping,
                layer_types=types or [FULL] * config.num_hidden_layers,
            )
        if config.model_type == "gemma3":
            hf["rope_local_base_freq"] = config.rope_local_base_freq or config.rope_theta
    else:
        first = types.index(SLIDING) if types else config.num_hidden_layers
        hf.update(
            use_sliding_window=types is not None,
            sliding_window=config.sliding_window,
            max_window_layers=first,
        )
        if types is not None and config.model_type != "qwen3_moe":
            hf["layer_types"] = types
        if config.model_type in ("qwen3", "qwen3_moe"):
            hf["attention_bias"] = False
        if config.model_type == "qwen3_moe":
            hf.update(
                num_experts=config.num_experts,
                num_experts_per_tok=config.num_experts_per_tok,
                moe_intermediate_size=config.moe_intermediate_size,
                norm_topk_prob=config.norm_topk_prob,
                decoder_sparse_step=config.decoder_sparse_step,
                mlp_only_layers=list(config.mlp_only_layers),
                router_aux_loss_coef=config.router_aux_loss_coef,
                output_router_logits=config.router_aux_loss_coef > 0,
            )
    return hf


def _int_if_whole(x: float | None) -> float | int | None:
    """``x`` as an int when it is one (transformers' Gemma configs type the field int)."""
    return int(x) if x is not None and float(x).is_integer() else x


@dataclasses.dataclass(frozen=True)
class _Tensor:
    path: tuple[str | int, ...]  # key path in the model state
    shape: tuple[int, ...]  # HF shape
    transpose: bool  # nn.Linear weight: [out, in] in HF, [in, ...out] in jaxrl
    layer: int | None = None  # scan_layers: the slot of the stacked state path; else None
    expert: int | None = None  # a MoE expert's tensor: its slot on the experts axis

    @property
    def slot(self) -> tuple[int, ...]:
        """The index of this tensor in its (stacked) state value: layer, then expert."""
        return tuple(i for i in (self.layer, self.expert) if i is not None)


def _tensor_map(config: ModelConfig) -> dict[str, _Tensor]:
    """HF tensor name -> where it lives in the jaxrl state."""
    d, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    dh = config.head_dim
    q, kv = config.num_attention_heads * dh, config.num_key_value_heads * dh
    names = {"model.embed_tokens.weight": _Tensor(("embedding",), (v, d), False)}
    names["model.norm.weight"] = _Tensor(("final_norm", "scale"), (d,), False)
    if not config.tie_word_embeddings:
        names["lm_head.weight"] = _Tensor(("lm_head",), (v, d), True)

    def layer_tensor(
        i: int,
        path: tuple[str, ...],
        shape: tuple[int, ...],
        transpose: bool,
        expert: int | None = None,
    ) -> _Tensor:
        """Unrolled: state path ("layers", i, ...); scanned: ("layers", ...) at slot i."""
        if config.scan_layers:
            return _Tensor(("layers", *path), shape, transpose, layer=i, expert=expert)
        return _Tensor(("layers", i, *path), shape, transpose, expert=expert)

    for i in range(config.num_hidden_layers):
        hf, tensor = f"model.layers.{i}.", functools.partial(layer_tensor, i)
        names[hf + "input_layernorm.weight"] = tensor(("input_norm", "scale"), (d,), False)
        if config.model_type in GEMMA_TYPES:  # norms on both sublayers' outputs (transformer.py)
            for hf_name, norm in (
                ("post_attention_layernorm", "attn_out_norm"),
                ("pre_feedforward_layernorm", "post_attn_norm"),
                ("post_feedforward_layernorm", "mlp_out_norm"),
            ):
                names[f"{hf}{hf_name}.weight"] = tensor((norm, "scale"), (d,), False)
        else:
            names[hf + "post_attention_layernorm.weight"] = tensor(
                ("post_attn_norm", "scale"), (d,), False
            )
        for proj, out in (("q", q), ("k", kv), ("v", kv)):
            names[f"{hf}self_attn.{proj}_proj.weight"] = tensor(
                ("attn", f"{proj}_kernel"), (out, d), True
            )
            if config.attention_bias:
                names[f"{hf}self_attn.{proj}_proj.bias"] = tensor(
                    ("attn", f"{proj}_bias"), (out,), False
                )
        names[hf + "self_attn.o_proj.weight"] = tensor(("attn", "o_kernel"), (d, q), True)
        if config.qk_norm:
            for proj in ("q", "k"):
                names[f"{hf}self_attn.{proj}_norm.weight"] = tensor(
                    ("attn", f"{proj}_norm", "scale"), (dh,), False
                )
        if config.is_moe_layer(i):
            names[hf + "mlp.gate.weight"] = tensor(
                ("mlp", "router_kernel"), (config.num_experts, d), True
            )
            fe = config.moe_intermediate_size
            for e in range(config.num_experts):
                for proj, shape in (("gate", (fe, d)), ("up", (fe, d)), ("down", (d, fe))):
                    names[f"{hf}mlp.experts.{e}.{proj}_proj.weight"] = tensor(
                        ("mlp", f"expert_{proj}_kernel"), shape, True, e
                    )
            continue
        for proj, shape in (("gate", (f, d)), ("up", (f, d)), ("down", (d, f))):
            names[f"{hf}mlp.{proj}_proj.weight"] = tensor(("mlp", f"{proj}_kernel"), shape, True)
    return names


def _key(path: tuple[Any, ...]) -> tuple[str | int, ...]:
    return tuple(getattr(p, "key", getattr(p, "idx", p)) for p in path)


def _within(path: Path, root: Path) -> bool:
    """``path`` resolves (symlinks and ``..`` followed) to a file inside ``root``."""
    return path.resolve().is_relative_to(root) and path.resolve() != root


def _open_safetensors(file: Path) -> Any:
    """``safe_open`` with an error that names the file (safetensors' own does not)."""
    try:
        return safe_open(str(file), framework="np")
    except Exception as e:  # SafetensorError is not a ValueError
        raise ValueError(
            f"{file} is not a readable safetensors file ({e}): it is truncated or damaged; "
            "re-download or re-export the model"
        ) from None


def _weight_files(root: Path) -> list[Path]:
    single, index = root / "model.safetensors", root / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(
                f"{index} is not a safetensors index ({type(e).__name__}: {e}): it must be JSON "
                'with a "weight_map" of tensor name -> shard file; re-save the checkpoint'
            ) from None
        inside = root.resolve()
        files = [root / name for name in names]
        outside = [n for n, f in zip(names, files, strict=True) if not _within(f, inside)]
        if outside:
            raise ValueError(
                f"{index} names shard files outside the model directory: {outside}; shard "
                "names must be plain file names in the directory (refusing to read them)"
            )
        missing = [str(p) for p in files if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} lists shards that do not exist: {missing}")
        return files
    present = sorted(p.name for p in root.iterdir())
    raise FileNotFoundError(
        f"{root}: no model.safetensors or model.safetensors.index.json (found {present}); "
        "jaxrl reads safetensors only: convert *.bin checkpoints with transformers first"
    )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}): repair or re-export it") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def from_pretrained(
    path: str | os.PathLike[str],
    *,
    param_dtype: str = "float32",
    dtype: str | None = None,
    matmul_dtype: str | None = None,
    fp32_lm_head: bool = False,
    scan_layers: bool = False,
    remat: str = "none",
    mesh: Mesh | None = None,
    attention_impl: str = "auto",
    attention_block_size: int = 128,
) -> Transformer:
    """Load a local HF directory (config.json + safetensors, single or sharded).

    With ``mesh``, each tensor goes straight onto its shards (``jaxrl.models.sharding`` rules):
    the host holds one tensor at a time and every device receives only its own block.
    ``attention_impl`` / ``attention_block_size``: see ``ModelConfig``.
    ``scan_layers`` / ``remat``: the layer stack's layout and rematerialisation
    (``ModelConfig``); a scanned model's stacked parameters are filled layer by layer on the
    devices, so the host still holds one tensor at a time.
    """
    config = read_config(
        path,
        param_dtype=param_dtype,
        dtype=dtype,
        matmul_dtype=matmul_dtype,
        fp32_lm_head=fp32_lm_head,
        attention_impl=attention_impl,
        attention_block_size=attention_block_size,
        scan_layers=scan_layers,
        remat=remat,
    )
    return load_pretrained(path, config, mesh=mesh)


def read_config(path: str | os.PathLike[str], **settings: Any) -> ModelConfig:
    """The ``ModelConfig`` of a local HF directory: its config.json (``config_from_hf``) with
    the run ``settings``; no weight is read. ``path`` may be a URL (``gs://...``: read from a
    local copy, ``jaxrl.runtime.storage.local``)."""
    root = Path(storage.local(path))
    if not root.is_dir():
        raise FileNotFoundError(
            f"{root}: not a directory; expected a local Hugging Face model directory with "
            "config.json and model.safetensors (jaxrl never downloads)"
        )
    config_path = root / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found: a HF model directory needs it")
    try:
        return config_from_hf(_read_json(config_path), **settings)
    except ValueError as e:
        raise ValueError(f"{config_path}: {e}") from None


def load_pretrained(
    path: str | os.PathLike[str], config: ModelConfig, *, mesh: Mesh | None = None
) -> Transformer:
    """The weights of a local HF directory in a model of ``config`` (``read_config`` of the same
    directory), each tensor placed on its shards when ``mesh`` is given."""
    root = Path(storage.local(path))  # a URL: its local copy (safetensors maps local files)
    with contextlib.ExitStack() as stack:
        # name -> open file; tensors are read one at a time, as the state is filled.
        tensors = {
            name: handle
            for file in _weight_files(root)
            for handle in [stack.enter_context(_open_safetensors(file))]
            for name in handle.keys()  # noqa: SIM118 - safe_open is not a Mapping
        }
        return _build(root, config, _text_tower(tensors), mesh)


class _Renamed:
    """A safetensors handle read under another tensor name (a multimodal text tower's)."""

    def __init__(self, handle: Any, name: str):
        self.handle, self.name = handle, name

    def get_tensor(self, _: str) -> np.ndarray:
        return self.handle.get_tensor(self.name)


def _text_tower(tensors: dict[str, Any]) -> dict[str, Any]:
    """The tensors of a ``Gemma3ForConditionalGeneration`` checkpoint's text tower under the
    causal LM's names (``model.language_model.X`` -> ``model.X``; the vision tower and the
    projector dropped); any other checkpoint's tensors unchanged."""
    prefix = next((p for p in _TOWER_PREFIXES if any(n.startswith(p) for n in tensors)), None)
    if prefix is None:
        return tensors
    out: dict[str, Any] = {}
    for name, handle in tensors.items():
        if name.startswith(prefix):
            out["model." + name.removeprefix(prefix)] = _Renamed(handle, name)
        elif not name.startswith(_TOWER_IGNORED):
            out[name] = handle  # lm_head.weight (tied: ignored), or an unexpected name
    return out


def _build(
    root: Path, config: ModelConfig, tensors: Mapping[str, Any], mesh: Mesh | None
) -> Transformer:
    expected = _tensor_map(config)
    missing = sorted(set(expected) - set(tensors))
    ignorable = {"lm_head.weight"} if config.tie_word_embeddings else set()
    unexpected = sorted(
        n
        for n in set(tensors) - set(expected)
        if n not in ignorable and not n.endswith(_IGNORED_SUFFIXES)
    )
    if missing or unexpected:
        raise ValueError(
            f"{root}: tensors do not match {config.model_type} with "
            f"{config.num_hidden_layers} layers: missing {missing}, unexpected {unexpected}"
        )
    by_path: dict[tuple[str | int, ...], list[tuple[str, _Tensor]]] = {}
    for name, spec in expected.items():  # one tensor per path, or one per layer slot (scanned)
        by_path.setdefault(spec.path, []).append((name, spec))
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
    shardings = abstract if mesh is None else state_shardings(abstract, mesh)
    dtype = jnp.dtype(config.param_dtype)

    def read(name: str, spec: _Tensor, shape: tuple[int, ...]) -> np.ndarray:
        """The tensor, checked, in jaxrl's layout and dtype (the one host copy)."""
        array = tensors[name].get_tensor(name)
        if array.shape != spec.shape:
            raise ValueError(
                f"{root}: tensor {name} has shape {array.shape}, expected {spec.shape}"
            )
        finite = np.isfinite(array.astype(np.float32, copy=False))
        if not finite.all():
            raise ValueError(
                f"{root}: tensor {name} holds {int(finite.size - finite.sum())} non-finite values "
                "(NaN or inf): the checkpoint is damaged; re-download or re-export it"
            )
        array = (array.T if spec.transpose else array).reshape(shape)
        return np.ascontiguousarray(array.astype(dtype))

    def place(array: np.ndarray, sharding: NamedSharding | None) -> jax.Array:
        if sharding is None:
            return jnp.asarray(array)
        return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])

    def load(
        key_path: tuple[Any, ...], variable: nnx.Variable, sharding: nnx.Variable
    ) -> nnx.Variable:
        entries = by_path[_key(key_path)]
        target = None if mesh is None else sharding.get_value()
        if not entries[0][1].slot:
            name, spec = entries[0]
            return variable.replace(place(read(name, spec, variable.shape), target))
        # scanned layers / experts: each layer's (expert's) tensor goes onto its shards, then
        # into its slot of the stacked buffer (donated, so the devices hold the stack plus one)
        n = len(entries[0][1].slot)
        slot_sharding = None if target is None else NamedSharding(mesh, P(*target.spec[n:]))
        stacked = _zeros(variable.shape, dtype, target)
        for name, spec in entries:
            piece = place(read(name, spec, variable.shape[n:]), slot_sharding)
            stacked = _set_slot(stacked, piece, np.asarray(spec.slot, np.int32))
        return variable.replace(stacked)

    state = jax.tree_util.tree_map_with_path(
        load, abstract, shardings, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
    return nnx.merge(graphdef, state)


def _zeros(shape: tuple[int, ...], dtype: Any, sharding: NamedSharding | None) -> jax.Array:
    """A zero array created directly in ``sharding`` (default device when None)."""
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()


@functools.partial(jax.jit, donate_argnums=0)
def _set_slot(stacked: jax.Array, piece: jax.Array, slot: jax.Array) -> jax.Array:
    """``stacked`` with ``stacked[slot]`` (``slot``: indices of its leading axes) replaced by
    ``piece`` (in place)."""
    start = (*slot, *([0] * piece.ndim))
    return jax.lax.dynamic_update_slice(
        stacked, piece.reshape((1,) * len(slot) + piece.shape), start
    )


def _atomic_write(path: Path, write: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def save_pretrained(
    model: Transformer,
    path: str | os.PathLike[str],
    *,
    dtype: str | None = None,
    generation_config: Mapping[str, Any] | None = None,
) -> None:
    """Write config.json and model.safetensors (atomically) that transformers can load.

    ``dtype``: the dtype of the written tensors and of ``torch_dtype`` (float32, bfloat16 or
    float16; None = the model's ``param_dtype``). ``generation_config``: the fields of
    generation_config.json (written when given); its special token ids (``bos_token_id``,
    ``eos_token_id``, ``pad_token_id``) also go into config.json, as transformers writes them.
    Sharded parameters are gathered; with several processes every process must call this
    (the gather is collective) and only process 0 writes.
    """
    root = Path(path)
    config = model.config
    dtype = dtype or config.param_dtype
    if dtype not in SAVE_DTYPES:
        raise ValueError(f"save_pretrained: dtype={dtype!r}; use one of {list(SAVE_DTYPES)}")
    values = {k: to_host(v) for k, v in _state_values(model).items()}
    if not is_primary():
        return
    root.mkdir(parents=True, exist_ok=True)
    tensors = {
        name: np.ascontiguousarray(_hf_layout(values[spec.path], spec, dtype))
        for name, spec in _tensor_map(config).items()
    }
    _atomic_write(
        root / "model.safetensors",
        lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt"}),
    )
    hf = config_to_hf(config, dtype=dtype)
    if generation_config is not None:
        hf.update({k: v for k, v in generation_config.items() if k in TOKEN_ID_KEYS})
        _write_json(root / "generation_config.json", generation_config)
    _write_json(root / "config.json", hf)


def hf_arrays(model: Transformer, *, dtype: str | None = None) -> Iterator[tuple[str, Any]]:
    """The tensors :func:`save_pretrained` writes (its names, HF layout and ``dtype``), as
    device arrays, one at a time and in its order, without going through the host: what a
    weight transfer to an inference server sends (jaxrl/rollout/vllm/transfer.py)."""
    dtype = dtype or model.config.param_dtype
    if dtype not in SAVE_DTYPES:
        raise ValueError(f"hf_arrays: dtype={dtype!r}; use one of {list(SAVE_DTYPES)}")
    values = _state_values(model)
    for name, spec in _tensor_map(model.config).items():
        yield name, _hf_layout(values[spec.path], spec, dtype)


def hf_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The names and shapes of the tensors :func:`hf_arrays` yields, in its order."""
    return {name: spec.shape for name, spec in _tensor_map(config).items()}


def _state_values(model: Transformer) -> dict[tuple[str | int, ...], Any]:
    """The model's state values by key path (device arrays)."""
    return {
        _key(p): v[...]
        for p, v in jax.tree_util.tree_leaves_with_path(
            nnx.state(model), is_leaf=lambda x: isinstance(x, nnx.Variable)
        )
    }


def _hf_layout(value: Any, spec: _Tensor, dtype: str) -> Any:
    """One HF tensor from its (stacked) state value, numpy or jax: the slot, HF's [out, in]
    for a linear kernel, HF's shape and ``dtype``."""
    value = value[spec.slot]
    if spec.transpose:
        value = value.reshape(math.prod(spec.shape[1:]), spec.shape[0]).T
    return value.reshape(spec.shape).astype(jnp.dtype(dtype), copy=False)


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    text = json.dumps(data, indent=2, sort_keys=True) + "\n"
    _atomic_write(path, lambda tmp: tmp.write_text(text))


def checkpoint_dtype(path: str | os.PathLike[str]) -> str | None:
    """The dtype a HF directory's config.json gives its weights (``torch_dtype``, or
    transformers v5's ``dtype``), when it is one ``save_pretrained`` writes; else None."""
    file = Path(storage.local(path)) / "config.json"
    hf = _read_json(file) if file.is_file() else {}
    value = str(hf.get("torch_dtype") or hf.get("dtype") or "").removeprefix("torch.")
    return value if value in SAVE_DTYPES else None


def read_generation_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A HF directory's generation settings: its generation_config.json without transformers'
    bookkeeping (``transformers_version``, ``_``-prefixed keys), or else the special token ids
    its config.json names; ``{}`` when it has neither."""
    root = Path(storage.local(path))
    file = root / "generation_config.json"
    if file.is_file():
        data = _read_json(file)
        return {
            k: v for k, v in data.items() if k != "transformers_version" and not k.startswith("_")
        }
    file = root / "config.json"
    hf = _read_json(file) if file.is_file() else {}
    return {k: hf[k] for k in TOKEN_ID_KEYS if hf.get(k) is not None}
