"""Every precision × mesh layout the config accepts compiles, or is refused by a ConfigError:
``jaxrl memory`` (XLA's CPU compiler) on tiny dense and MoE models, full fine-tuning and LoRA,
ends with exit 0 or 2 — never a signal. A native abort inside the compiler (XLA:CPU's
``all-reduce-promotion`` pass once aborted bf16 masters under ZeRO-3, docs/precision.md) kills
the whole process, so the plans run in a subprocess whose end is observable; the subprocess
prints each layout before planning it, so a signal names the layout that raised it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

DENSE = (
    "model.init={hidden_size: 64, num_hidden_layers: 1, num_attention_heads: 4, "
    "num_key_value_heads: 2, intermediate_size: 128, vocab_size: 64}"
)
MOE = (
    "model.init={model_type: qwen3_moe, hidden_size: 64, num_hidden_layers: 1, "
    "num_attention_heads: 4, num_key_value_heads: 2, intermediate_size: 128, num_experts: 8, "
    "num_experts_per_tok: 2, moe_intermediate_size: 32, vocab_size: 64}"
)
PRECISIONS = {  # master weights / compute
    "fp32": ["model.param_dtype=float32", "model.dtype=float32"],
    "fp32+bf16": ["model.param_dtype=float32", "model.dtype=bfloat16"],
    "bf16": ["model.param_dtype=bfloat16", "optimizer.master_rounding=stochastic"],
    "bf16+fp32": [
        "model.param_dtype=bfloat16",
        "model.dtype=float32",
        "optimizer.master_rounding=nearest",
    ],
}
SCANNED = ["model.scan_layers=true", "model.remat=block"]
MESHES = {
    "data8": ["mesh.data=8"],
    "fsdp8": ["mesh.data=1", "mesh.fsdp=8"],
    "fsdp8-scan": ["mesh.data=1", "mesh.fsdp=8", *SCANNED],
    "d2f2t2": ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", *SCANNED],
}
MOE_MESHES = {  # the MoE block under ZeRO-3 and under expert parallelism (with fsdp, tensor)
    "fsdp8-scan": MESHES["fsdp8-scan"],
    "d2e4": ["mesh.data=2", "mesh.expert=4", *SCANNED],
    "f2e2t2": ["mesh.data=1", "mesh.fsdp=2", "mesh.expert=2", "mesh.tensor=2", *SCANNED],
}
LORA = ["model.lora.rank=4", "model.lora.alpha=8"]


def _layouts() -> list[tuple[str, list[str]]]:
    """Every precision on every mesh, dense and MoE; LoRA (its frozen base as fsdp shards) in
    the bf16-compute precisions on ZeRO-3."""
    out = []
    for model, init, meshes in (("dense", DENSE, MESHES), ("moe", MOE, MOE_MESHES)):
        for p, precision in PRECISIONS.items():
            for m, mesh in meshes.items():
                out.append((f"{model}/{p}/{m}", [init, *precision, *mesh]))
        for p in ("fp32+bf16", "bf16"):
            sets = [init, *PRECISIONS[p], *MESHES["fsdp8-scan"], *LORA]
            out.append((f"{model}/{p}/fsdp8-scan/lora", sets))
    return out


SCRIPT = """
import sys, json
from jaxrl.cli import main
for name, sets in json.loads(sys.argv[1]):
    print("PLAN", name, flush=True)
    args = ["memory", "configs/sft_tiny.yaml", "--set", "schedule.max_tokens=32"]
    for s in sets:
        args += ["--set", s]
    print("EXIT", name, main(args), flush=True)
"""


@pytest.mark.slow
def test_every_accepted_precision_and_mesh_plans_or_is_refused_never_a_signal():
    import json

    layouts = _layouts()
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(layouts)],
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
    )
    lines = proc.stdout.splitlines()
    started = [line.split()[1] for line in lines if line.startswith("PLAN ")]
    codes = {line.split()[1]: int(line.split()[2]) for line in lines if line.startswith("EXIT ")}
    assert proc.returncode == 0, (
        f"the planner process ended with {proc.returncode} while planning "
        f"{started[-1] if started else '?'}: {proc.stderr[-2000:]}"
    )
    assert sorted(codes) == sorted(name for name, _ in layouts)
    bad = {name: code for name, code in codes.items() if code not in (0, 2)}
    assert not bad, (bad, proc.stderr[-2000:])
    planned = [name for name, code in codes.items() if code == 0]
    # ZeRO-3 with bf16 masters (dense and MoE, full and LoRA) compiles: it is never refused
    assert {"dense/bf16/fsdp8", "dense/bf16/fsdp8-scan", "moe/bf16/fsdp8-scan/lora"} <= set(
        planned
    ), codes
