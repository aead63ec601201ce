"""Full fine-tuning vs LoRA vs QLoRA: planned memory (``jaxrl memory``) and SFT step time.

    python benchmarks/lora_bench.py --memory                # ~100M and Qwen2.5-7B shapes
    python benchmarks/lora_bench.py --time --repeats 3      # ~100M step time on this machine

Variants (``model.lora.*`` overrides of one SFT config): ``full`` (fp32 masters, AdamW on every
weight), ``lora`` (rank 16 on all seven projections, base frozen in the compute dtype),
``qlora-int8`` and ``qlora-nf4`` (the same adapters on an int8 / nf4 base). Memory comes from
``jaxrl.train.run_io.memory.plan_memory`` (abstract: nothing is allocated, so the 7B plan runs on a
laptop; CPU compiler temporaries). Step time runs the real ``Session`` SFT step (as
``train_bench.py``) on the same random documents for every variant, the variants taking their
steps round-robin so load drift hits all alike; each variant reports the median and the spread
(min-max) of its steps after the compile step, over ``--repeats`` rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_bench import SHAPES, JaxrlVariant, documents  # noqa: E402

from jaxrl.config import load_run_config  # noqa: E402
from jaxrl.train.run_io.memory import plan_memory  # noqa: E402

VARIANTS = {
    "full": [],
    "lora": ["model.lora.rank=16", "model.lora.alpha=32"],
    "qlora-int8": ["model.lora.rank=16", "model.lora.alpha=32", "model.lora.quantize=int8"],
    "qlora-nf4": ["model.lora.rank=16", "model.lora.alpha=32", "model.lora.quantize=nf4"],
}
QWEN25_7B = [
    "model.init.model_type=qwen2",
    "model.init.attention_bias=true",
    "model.init.hidden_size=3584",
    "model.init.num_hidden_layers=28",
    "model.init.num_attention_heads=28",
    "model.init.num_key_value_heads=4",
    "model.init.intermediate_size=18944",
    "model.init.vocab_size=152064",
    "model.init.tie_word_embeddings=false",
    "model.init.rope_theta=1000000.0",
]
PLAN_SHAPES = {
    # ~100M: train_bench's shape, fp32 (the CPU setting of the step-time runs)
    "100m": [*SHAPES["100m"], "schedule.max_tokens=1024"],
    # Qwen2.5-7B on one accelerator: bf16 compute, fp32 masters for full fine-tuning
    "qwen2.5-7b": [
        *QWEN25_7B,
        "model.dtype=bfloat16",
        "model.scan_layers=true",
        "model.remat=block",
        "model.logprob_chunk=512",
        "schedule.max_tokens=2048",
    ],
}
GIB = 1 << 30


def memory(args: argparse.Namespace) -> list[dict]:
    rows = []
    for shape, overrides in PLAN_SHAPES.items():
        for name, lora in VARIANTS.items():
            cfg = load_run_config(args.config, [*overrides, *lora, "mesh.data=1"])
            plan = plan_memory(cfg)
            row = {
                "shape": shape,
                "variant": name,
                "trainable": (plan["lora"] or {}).get("trainable_params", plan["num_params"]),
                **{k: plan[k] for k in ("params_bytes", "optimizer_bytes", "grads_bytes")},
                **{k: plan[k] for k in ("temp_bytes", "total_bytes", "compile_s")},
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def step_time(args: argparse.Namespace) -> list[dict]:
    base = [
        *SHAPES["100m"],
        "logging.progress=false",
        "mesh.data=1",
        f"schedule.max_tokens={args.max_tokens}",
        "model.scan_layers=true",
        "checkpoint.every=0",
    ]
    cfg = load_run_config(args.config, base)
    targs = argparse.Namespace(
        shape="100m", docs=args.docs, steps=args.steps * args.repeats, min_len=32, max_len=96
    )
    seqs, masks, vocab = documents(cfg, targs)
    out = Path(tempfile.mkdtemp(prefix="lora_bench_"))
    variants = {
        name: JaxrlVariant(args, [*base, *lora], vocab, seqs, masks, out / name)
        for name, lora in VARIANTS.items()
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    n = args.docs
    for step in range(args.steps * args.repeats + 1):
        ids = list(range(step * n, (step + 1) * n))
        for name, variant in variants.items():
            started = time.perf_counter()
            variant.step(ids)
            if step:  # step 0 compiles
                times[name].append(time.perf_counter() - started)
    rows = []
    for name, ts in times.items():
        row = {
            "variant": name,
            "steps": len(ts),
            "median_s": round(statistics.median(ts), 3),
            "min_s": round(min(ts), 3),
            "max_s": round(max(ts), 3),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/sft_tiny.yaml")
    parser.add_argument("--memory", action="store_true")
    parser.add_argument("--time", action="store_true")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--docs", type=int, default=4, help="documents per step")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per repeat")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.memory:
        rows = memory(args)
        print("\n| shape | variant | trainable | params | optimizer | grads | temp | total |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            gib = [
                f"{r[k] / GIB:.2f}"
                for k in ("params_bytes", "optimizer_bytes", "grads_bytes", "temp_bytes")
            ]
            print(
                f"| {r['shape']} | {r['variant']} | {r['trainable'] / 1e6:.1f}M | "
                + " | ".join(gib)
                + f" | {r['total_bytes'] / GIB:.2f} |"
            )
    if args.time:
        rows = step_time(args)
        print("\n| variant | median s/step | min | max | steps |")
        print("|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {r['variant']} | {r['median_s']} | {r['min_s']} | {r['max_s']} | {r['steps']} |"
            )


if __name__ == "__main__":
    main()
