"""The sparse MoE block of Qwen3-MoE in Flax NNX (``transformer.Block``'s MLP on MoE layers).

Parameters (HF tensors in ``models/hf.py``):

- ``router_kernel [D, E]`` (``mlp.gate.weight``, logical ``("embed", "router_experts")``);
- ``expert_gate_kernel`` / ``expert_up_kernel [E, D, F]`` and ``expert_down_kernel [E, F, D]``
  (``mlp.experts.{e}.{gate,up,down}_proj.weight``), logical ``("expert", "embed", "moe_mlp")``:
  split over the ``expert`` mesh axis by experts, over ``fsdp`` by the model dimension (ZeRO-3
  gathers them in-layer through ``fsdp.weight`` as every other weight) and over ``tensor`` by
  the expert FFN units;
- with LoRA targeting ``gate_proj`` / ``up_proj`` / ``down_proj``, one adapter per expert
  (:class:`ExpertLoRA`, ``A [E, in, r]``, ``B [E, r, out]``), run by the same grouped matmul.

The computation is ``grouped.py``'s; the ``expert`` mesh axis (``expert_parallel.py``) makes
each device compute only its experts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.models.fsdp import weight
from jaxrl.models.model_config import LoraSpec, ModelConfig
from jaxrl.models.moe import expert_parallel
from jaxrl.models.moe.grouped import ExpertWeights, Routing, experts, route

_INIT_STD = 0.02


def _param(key: jax.Array, shape: tuple[int, ...], axes: tuple[str, ...], dtype: str) -> nnx.Param:
    value = _INIT_STD * jax.random.normal(key, shape, jnp.float32)
    return nnx.Param(value.astype(dtype), out_sharding=axes, eager_sharding=False)


class ExpertLoRA(nnx.Module):
    """Per-expert LoRA factors ``A [E, in, r]`` (PEFT's kaiming-uniform, bound ``1/sqrt(in)``)
    and ``B [E, r, out]`` (zero), float32 ``nnx.LoRAParam``; ``lora.merge`` adds
    ``scaling · A_e B_e`` to each expert's kernel (a batched matmul)."""

    def __init__(
        self,
        experts_: int,
        shape: tuple[int, int],
        axes: tuple[str, str],
        rank: int,
        dtype: str,
        rngs: nnx.Rngs,
    ):
        fan_in = shape[0]
        bound = 1.0 / fan_in**0.5
        a = jax.random.uniform(rngs.params(), (experts_, fan_in, rank), jnp.float32, -bound, bound)
        meta = dict(eager_sharding=False)
        self.lora_a = nnx.LoRAParam(a, out_sharding=("expert", axes[0], None), **meta)
        self.lora_b = nnx.LoRAParam(
            jnp.zeros((experts_, rank, shape[1]), jnp.float32),
            out_sharding=("expert", None, axes[1]),
            **meta,
        )
        self.dtype = jnp.dtype(dtype)

    def factors(self) -> tuple[jax.Array, jax.Array]:
        return weight(self.lora_a, self.dtype), weight(self.lora_b, self.dtype)


def _expert_adapter(
    spec: LoraSpec | None,
    target: str,
    e: int,
    shape: tuple[int, int],
    axes: tuple[str, str],
    dtype: str,
    rngs: nnx.Rngs | None,
) -> ExpertLoRA | None:
    if spec is None or not spec.targets(target):
        return None
    return ExpertLoRA(e, shape, axes, spec.rank, dtype, rngs)


class MoE(nnx.Module):
    """Router + experts: ``moe(x_BTD, replay_BTK) -> (y_BTD, Routing of the B·T tokens)``."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, lora_rngs: nnx.Rngs | None = None):
        e, d, f = config.num_experts, config.hidden_size, config.moe_intermediate_size
        pd, cd, lora = config.param_dtype, config.dtype, config.lora
        self.router_kernel = _param(rngs.params(), (d, e), ("embed", "router_experts"), pd)
        self.expert_gate_kernel = _param(
            rngs.params(), (e, d, f), ("expert", "embed", "moe_mlp"), pd
        )
        self.expert_up_kernel = _param(rngs.params(), (e, d, f), ("expert", "embed", "moe_mlp"), pd)
        self.expert_down_kernel = _param(
            rngs.params(), (e, f, d), ("expert", "moe_mlp", "embed"), pd
        )
        din, dout = ("embed", "moe_mlp"), ("moe_mlp", "embed")
        self.expert_gate_lora = _expert_adapter(lora, "gate_proj", e, (d, f), din, cd, lora_rngs)
        self.expert_up_lora = _expert_adapter(lora, "up_proj", e, (d, f), din, cd, lora_rngs)
        self.expert_down_lora = _expert_adapter(lora, "down_proj", e, (f, d), dout, cd, lora_rngs)
        self.scaling = lora.scaling if lora is not None and lora.rank else 0.0
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob

    def __call__(
        self, x_BTD: jax.Array, replay_BTK: jax.Array | None = None
    ) -> tuple[jax.Array, Routing]:
        b, t, d = x_BTD.shape
        dt = x_BTD.dtype
        x_ND = x_BTD.reshape(b * t, d)
        replay_NK = None if replay_BTK is None else replay_BTK.reshape(b * t, -1)
        router_DE = weight(self.router_kernel, jnp.float32)
        routing = route(x_ND, router_DE, self.top_k, self.norm_topk_prob, replay_NK)

        def lora(adapter: ExpertLoRA | None) -> tuple[jax.Array, jax.Array] | None:
            return None if adapter is None else adapter.factors()

        w = ExpertWeights(
            weight(self.expert_gate_kernel, dt),
            weight(self.expert_up_kernel, dt),
            weight(self.expert_down_kernel, dt),
            lora(self.expert_gate_lora),
            lora(self.expert_up_lora),
            lora(self.expert_down_lora),
            self.scaling,
        )
        y_ND = expert_parallel.run(x_ND, routing, w, experts)
        return y_ND.reshape(b, t, d), routing
