"""Compile time and step memory of the layer stack: unrolled vs ``model.scan_layers``, and
``model.remat`` none vs block. Nothing is allocated: everything is lowered and compiled on
abstract shapes (``jax.ShapeDtypeStruct``), as ``jaxrl memory`` does.

1. Compile time: ``jax.jit(value_and_grad(loss)).lower(...).compile()`` of the model's forward
   and backward (a Qwen2.5-1.5B shape, bf16, one row of ``--tokens``), default XLA options,
   unrolled vs scanned side by side.
2. Memory: ``jaxrl.train.run_io.memory.plan_memory`` (the real train step: shard_map accumulation,
   clipping, AdamW) of the same shape at ``--memory-tokens`` tokens per row, one device, remat
   none vs block, unrolled and scanned; then the same on fsdp=8.

    python benchmarks/compile_bench.py [--layers 28] [--tokens 2048] [--memory-tokens 8192]

Results and the machine they ran on: benchmarks/README.md.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from jaxrl.config import load_run_config  # noqa: E402
from jaxrl.models.model_config import ModelConfig  # noqa: E402
from jaxrl.models.transformer import Transformer  # noqa: E402
from jaxrl.runtime.mesh import use_devices  # noqa: E402
from jaxrl.train.run_io.memory import plan_memory  # noqa: E402

QWEN25_1_5B = dict(  # Qwen/Qwen2.5-1.5B config.json
    model_type="qwen2",
    vocab_size=151936,
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    tie_word_embeddings=True,
)


def compile_forward_backward(config: ModelConfig, tokens: int) -> tuple[float, float]:
    """``(lower_s, compile_s)`` of the gradient of a next-token loss on one row."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
    ids = jax.ShapeDtypeStruct((1, tokens), jnp.int32)

    def loss(state, ids):
        logits = nnx.merge(graphdef, state)(ids).astype(jnp.float32)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), ids[..., None], -1))

    started = time.perf_counter()
    lowered = jax.jit(jax.value_and_grad(loss)).lower(state, ids)
    lowered_at = time.perf_counter()
    lowered.compile()
    return lowered_at - started, time.perf_counter() - lowered_at


def memory_plan(layers: int, tokens: int, mesh: list[str], **model: object) -> dict:
    init = {k: v for k, v in QWEN25_1_5B.items()} | {"num_hidden_layers": layers}
    shape = "{" + ", ".join(f"{k}: {v}" for k, v in init.items()) + "}"
    sets = [
        f"model.init={shape}",
        "model.param_dtype=bfloat16",
        "optimizer.master_rounding=stochastic",
        f"schedule.max_tokens={tokens}",
    ]
    sets += [f"model.{k}={str(v).lower()}" for k, v in model.items()] + mesh
    return plan_memory(load_run_config("configs/sft_tiny.yaml", sets))


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--tokens", type=int, default=2048, help="row length for compile time")
    parser.add_argument("--memory-tokens", type=int, default=8192, help="row length for memory")
    parser.add_argument("--skip-memory", action="store_true")
    args = parser.parse_args()
    base = ModelConfig(
        **(QWEN25_1_5B | {"num_hidden_layers": args.layers}),
        attention_bias=True,
        param_dtype="bfloat16",
    )
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}, {os.cpu_count()} CPUs")
    print(f"\n## compile: forward + backward, Qwen2.5-1.5B shape, {args.layers} layers, "
          f"bf16, 1 x {args.tokens} tokens")  # fmt: skip
    print("| layout | lower s | compile s | total s |\n|---|---|---|---|")
    totals = {}
    for scan in (False, True):
        lower_s, compile_s = compile_forward_backward(
            dataclasses.replace(base, scan_layers=scan), args.tokens
        )
        totals[scan] = lower_s + compile_s
        name = "scanned" if scan else "unrolled"
        print(f"| {name} | {lower_s:.1f} | {compile_s:.1f} | {totals[scan]:.1f} |")
    print(f"scanned / unrolled = {totals[True] / totals[False]:.3f}")
    if args.skip_memory:
        return
    with use_devices(jax.devices(), subset=True):
        print(f"\n## train step memory (jaxrl memory): {args.memory_tokens} tokens per row, GiB")
        print("| mesh | layout | remat | temp | total | lower+compile s |")
        print("|---|---|---|---|---|---|")
        rows = [
            (["mesh.data=1"], scan, remat) for scan in (False, True) for remat in ("none", "block")
        ]
        fsdp8 = ["mesh.data=1", "mesh.fsdp=8"]
        rows += [(fsdp8, scan, remat) for scan in (False, True) for remat in ("none", "block")]
        for mesh, scan, remat in rows:
            plan = memory_plan(args.layers, args.memory_tokens, mesh, scan_layers=scan, remat=remat)
            name = "scanned" if scan else "unrolled"
            seconds = plan["lower_s"] + plan["compile_s"]
            print(
                f"| {' '.join(m.split('.')[1] for m in mesh)} | {name} | {remat} | "
                f"{_gib(plan['temp_bytes'])} | {_gib(plan['total_bytes'])} | {seconds:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
