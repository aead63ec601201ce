"""LoRA adapters in PEFT's format: ``adapter_config.json`` + ``adapter_model.safetensors``.

The directory ``peft.PeftModel.from_pretrained(base, path)`` loads onto the HF model of the same
base. Tensor names are PEFT's for a ``*ForCausalLM`` wrapped in a ``PeftModel``::

    base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight   [r, in]
    base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight   [out, r]

(``nn.Linear`` layout: jaxrl's ``A [in, r]`` and ``B [r, out]`` transposed; multi-head
projections on their flat ``H·Dh`` axis, as in ``hf.py``). The scaling is PEFT's:
``lora_alpha / r`` or, with ``use_rslora``, ``lora_alpha / sqrt(r)``. Reading takes the same
files back (``read_lora_spec``, ``load_adapters``), e.g. to continue training an adapter.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxrl.models.adapters.lora_layer import ADAPTERS
from jaxrl.models.adapters.quantize import KERNELS
from jaxrl.models.model_config import ALL_LINEAR, LORA_TARGETS, LoraSpec, ModelConfig
from jaxrl.runtime import storage
from jaxrl.runtime.mesh import is_primary, to_host

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_MODULE = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn"}
_MODULE |= {"o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_OWNER = {"self_attn": "attn", "mlp": "mlp"}


def _tensor_name(layer: int, target: str, which: str) -> str:
    return f"base_model.model.model.layers.{layer}.{_MODULE[target]}.{target}.lora_{which}.weight"


def _adapter_paths(config: ModelConfig) -> list[tuple[int, str, tuple[Any, ...], int | None]]:
    """``(layer, target, state path of the adapter module, slot)`` of every adapter; the slot
    is the layer's index on the stacked axis with ``scan_layers`` (else None)."""
    spec = config.lora
    if config.moe_layers:
        raise ValueError(
            "PEFT adapter directories of MoE models (per-expert adapters) are not supported: "
            "export the merged model with save_pretrained instead"
        )
    out = []
    for i in range(config.num_hidden_layers):
        for kernel, (target, _) in KERNELS.items():
            if kernel.startswith("expert_"):  # a MoE block's experts (refused above)
                continue
            if spec is None or not spec.targets(target):
                continue
            owner = _OWNER[_MODULE[target]]
            if config.scan_layers:
                out.append((i, target, ("layers", owner, ADAPTERS[kernel]), i))
            else:
                out.append((i, target, ("layers", i, owner, ADAPTERS[kernel]), None))
    return out


def adapter_config(spec: LoraSpec, base_model: str | None) -> dict[str, Any]:
    """PEFT's ``LoraConfig`` fields for ``spec`` (what ``adapter_config.json`` holds)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(spec.target_modules),
        "use_rslora": spec.use_rslora,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }


def save_adapters(
    model: nnx.Module, path: str | os.PathLike[str], *, base_model: str | None = None
) -> Path:
    """Write ``model``'s adapters (float32) as a PEFT adapter directory; returns it. Sharded
    adapters are gathered (every process calls this; process 0 writes)."""
    config: ModelConfig = model.config
    if config.lora is None or config.lora.rank == 0:
        raise ValueError("save_adapters: the model has no adapters (model.lora.rank is 0)")
    state = nnx.state(model, nnx.LoRAParam)
    tensors = {}
    for layer, target, path_, slot in _adapter_paths(config):
        node = state
        for key in path_:
            node = node[key]
        for which, name in (("A", "lora_a"), ("B", "lora_b")):
            value = to_host(node[name][...])
            value = value if slot is None else value[slot]
            tensors[_tensor_name(layer, target, which)] = np.ascontiguousarray(
                value.T.astype(np.float32)
            )
    root = Path(path)
    if is_primary():
        root.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(root / WEIGHTS_FILE), metadata={"format": "pt"})
        text = json.dumps(adapter_config(config.lora, base_model), indent=2, sort_keys=True)
        (root / CONFIG_FILE).write_text(text + "\n")
    return root


def read_lora_spec(path: str | os.PathLike[str], *, quantize: str = "none") -> LoraSpec:
    """The ``LoraSpec`` of a PEFT adapter directory (``ValueError`` naming what is unsupported)."""
    file = Path(storage.local(path)) / CONFIG_FILE  # a URL: its local copy
    if not file.is_file():
        raise FileNotFoundError(f"{file} not found: a PEFT adapter directory needs it")
    cfg = json.loads(file.read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{file}: peft_type={cfg.get('peft_type')!r}; only LORA adapters load")
    targets = cfg.get("target_modules") or ALL_LINEAR
    if isinstance(targets, str):
        if targets != ALL_LINEAR:
            raise ValueError(f"{file}: target_modules={targets!r}: use a list of {LORA_TARGETS}")
        targets = LORA_TARGETS
    for key, ok in (("bias", "none"), ("fan_in_fan_out", False)):
        if cfg.get(key, ok) != ok:
            raise ValueError(f"{file}: {key}={cfg[key]!r} is not supported (only {ok!r})")
    if cfg.get("modules_to_save"):
        raise ValueError(f"{file}: modules_to_save={cfg['modules_to_save']} is not supported")
    return LoraSpec(
        rank=int(cfg["r"]),
        alpha=float(cfg.get("lora_alpha", 8)),
        target_modules=tuple(targets),
        use_rslora=bool(cfg.get("use_rslora", False)),
        quantize=quantize,
    )


def load_adapters(
    path: str | os.PathLike[str], config: ModelConfig, adapters: nnx.State, shardings: Any = None
) -> nnx.State:
    """``adapters`` (the ``nnx.LoRAParam`` state of a model of ``config``) with the values of
    the PEFT directory ``path``, in ``adapters``' dtypes (and ``shardings``, a matching tree of
    NamedShardings, when given)."""
    file = Path(storage.local(path)) / WEIGHTS_FILE
    with safe_open(str(file), "np") as f:
        names = set(f.keys())  # noqa: SIM118 - safe_open is not a Mapping
        values: dict[tuple[Any, ...], np.ndarray] = {}
        expected = set()
        for layer, target, path_, slot in _adapter_paths(config):
            for which, name in (("A", "lora_a"), ("B", "lora_b")):
                tensor = _tensor_name(layer, target, which)
                expected.add(tensor)
                if tensor not in names:
                    raise ValueError(f"{file}: tensor {tensor} is missing")
                value = f.get_tensor(tensor).T
                key = (*path_, name)
                if slot is None:
                    values[key] = value
                else:
                    values.setdefault(key, []).append(value)
    extra = sorted(n for n in names - expected if not n.endswith(".bias"))
    if extra:
        raise ValueError(f"{file}: tensors the model has no adapter for: {extra[:4]}")

    def fill(p: tuple[Any, ...], v: nnx.Variable, s: Any = None) -> nnx.Variable:
        key = tuple(getattr(k, "key", getattr(k, "idx", k)) for k in p)
        value = values[key]
        value = np.stack(value) if isinstance(value, list) else value
        if value.shape != tuple(v.shape):
            raise ValueError(f"{file}: adapter {key} has shape {value.shape}, expected {v.shape}")
        array = jnp.asarray(value, v.dtype)
        if isinstance(s, nnx.Variable):
            s = s.get_value()
        if isinstance(s, NamedSharding):
            array = jax.device_put(array, s)
        return v.replace(array)

    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    if shardings is None:
        return jax.tree_util.tree_map_with_path(fill, adapters, is_leaf=is_var)
    return jax.tree_util.tree_map_with_path(fill, adapters, shardings, is_leaf=is_var)
