"""Regenerate docs/scale_out.md's "Will it fit the target" table from the target compilers.

Each row is one ``jaxrl memory CONFIG --topology TARGET --json`` (libtpu for TPU targets, the
CUDA plugin for GPU nodes: ``pip install -e ".[tpu-plan]"`` / ``".[gpu-plan]"``), run one at a
time in a subprocess; its JSON is kept in ``benchmarks/results/target_fit/ROW.json`` and the
table between the ``target-fit`` markers of docs/scale_out.md is rewritten from every kept
result. The model shapes are the Qwen2.5 config.json files (written to a temporary directory:
``jaxrl memory`` reads only the shape of a ``model.path``).

    python benchmarks/target_fit.py                 # every row, then the table
    python benchmarks/target_fit.py --only q7-grpo-v5p16 q7-grpo-h100
    python benchmarks/target_fit.py --render        # the table from the kept results only

A 7B GRPO row compiles its four programs in minutes on two loaded CPU cores; the 32B row on 64
devices takes longer. A row that the compiler refuses (out of HBM) is kept with its one-line
verdict.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "target_fit"
DOC = ROOT / "docs" / "scale_out.md"
BEGIN, END = "<!-- target-fit:begin -->", "<!-- target-fit:end -->"

QWEN = {  # Qwen2.5 *-Instruct config.json fields that set the shape
    "1.5B": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                 tie_word_embeddings=True),
    "7B": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4),
    "32B": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                num_attention_heads=40, num_key_value_heads=8),
    "72B": dict(hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
                num_attention_heads=64, num_key_value_heads=8),
}  # fmt: skip
COMMON = dict(
    architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_act="silu", rms_norm_eps=1e-6,
    rope_theta=1000000.0, max_position_embeddings=32768, vocab_size=152064,
    tie_word_embeddings=False, torch_dtype="bfloat16",
)  # fmt: skip
ZERO3 = ["model.scan_layers=true", "model.remat=block", "model.dtype=bfloat16"]

# id -> (model, config, target, --set overrides, what)
ROWS: dict[str, tuple[str, str, str, list[str], str]] = {
    "q7-grpo-v5p16": ("7B", "configs/grpo_gsm8k_qwen_7b.yaml", "v5p-16", [], "GRPO, as shipped"),
    "q7-grpo-h100": ("7B", "configs/grpo_gsm8k_qwen_7b.yaml", "h100:8", [], "GRPO, as shipped"),
    "q7-sft-v6e8": (
        "7B", "configs/sft_qwen.yaml", "v6e-8",
        ["mesh.data=1", "mesh.fsdp=8", "schedule.max_tokens=4096", *ZERO3], "SFT, fsdp=8",
    ),
    "q7-dpo-v6e8": (
        "7B", "configs/dpo_qwen.yaml", "v6e-8",
        ["mesh.data=1", "mesh.fsdp=8", "schedule.max_tokens=2048", *ZERO3], "DPO, fsdp=8",
    ),
    "q32-grpo-v5p128": (
        "32B", "configs/grpo_gsm8k_qwen_32b.yaml", "v5p-128", [], "GRPO, as shipped",
    ),
    "q1.5-lora-grpo-h100": (
        "1.5B", "configs/grpo_gsm8k_qwen_lora.yaml", "h100:8", [], "GRPO LoRA, as shipped",
    ),
    "q72-sft-v5e4": (
        "72B", "configs/sft_qwen.yaml", "v5e:2x2",
        ["mesh.data=1", "mesh.fsdp=4", "schedule.max_tokens=512", "sft.max_length=512", *ZERO3],
        "SFT (refused)",
    ),
}  # fmt: skip


def model_dirs(root: Path) -> dict[str, Path]:
    """A config.json per Qwen2.5 shape under ``root``."""
    out = {}
    for name, shape in QWEN.items():
        d = root / f"Qwen2.5-{name}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps({**COMMON, **shape}, indent=1))
        out[name] = d
    return out


def run_row(row: str, models: dict[str, Path]) -> dict:
    """One ``jaxrl memory --topology`` in a subprocess: its JSON, or its refusal line."""
    model, config, target, sets, what = ROWS[row]
    cmd = [sys.executable, "-m", "jaxrl.cli", "memory", config, "--topology", target, "--json"]
    for s in [f"model.path={models[model]}", *sets]:
        cmd += ["--set", s]
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ))
    wall = time.perf_counter() - started
    result: dict = {"row": row, "model": model, "config": config, "target": target}
    result.update(sets=sets, what=what, exit=proc.returncode, wall_s=round(wall, 1))
    try:
        result["plan"] = json.loads(proc.stdout)
    except json.JSONDecodeError:
        result["plan"] = None
    lines = [line for line in proc.stderr.splitlines() if ": does not fit" in line]
    lines = lines or [line for line in proc.stderr.splitlines() if line.startswith("config error")]
    errors = [line for line in proc.stderr.splitlines() if "rror" in line]
    result["verdict"] = lines[-1] if lines else (errors[-1][:300] if errors else "")
    return result


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def render(results: list[dict]) -> str:
    """The Markdown table of ``results`` (kept rows, in :data:`ROWS` order)."""
    head = (
        "| model | run | target (compiler) | mesh | train step | scorer | sampler | "
        "per-chip peak | usable | fits | compile |\n|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in results:
        plan = r["plan"]
        if plan is None:
            lines.append(
                f"| {r['model']} | {r['what']} | {r['target']} | | | | | | | "
                f"**no**: {r['verdict'] or 'exit ' + str(r['exit'])} | {r['wall_s']:.0f} s |"
            )
            continue
        peaks = {p["name"]: p["peak_bytes"] for p in plan["programs"]}
        mesh = " × ".join(f"{a}={s}" for a, s in plan["mesh"].items() if s > 1) or "1"
        compiler = "libtpu" if plan["platform"] == "tpu" else "XLA:GPU"
        sampler = peaks.get("sampler_prefill_decode")
        lines.append(
            f"| {r['model']} | {r['what']} | {r['target']} ({compiler}) | {mesh} | "
            f"{_gib(peaks['train_step'])} | {_gib(peaks['scorer'])} | "
            f"{_gib(sampler) if sampler else '-'} | **{_gib(plan['peak_bytes'])}** | "
            f"{_gib(plan['device_bytes'])} | {'yes' if plan['fits'] else 'no'} | "
            f"{r['wall_s']:.0f} s |"
        )
    return "\n".join(lines)


def write_table() -> None:
    kept = [RESULTS / f"{row}.json" for row in ROWS if (RESULTS / f"{row}.json").is_file()]
    table = render([json.loads(p.read_text()) for p in kept])
    text = DOC.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    DOC.write_text(text[:start] + "\n" + table + "\n" + text[end:])
    print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=None, help="rows to run (default: all)")
    parser.add_argument("--render", action="store_true", help="rewrite the table only")
    args = parser.parse_args()
    if not args.render:
        RESULTS.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            models = model_dirs(Path(tmp))
            for row in args.only or list(ROWS):
                result = run_row(row, models)
                (RESULTS / f"{row}.json").write_text(json.dumps(result, indent=1) + "\n")
                print(f"{row}: exit {result['exit']} in {result['wall_s']} s {result['verdict']}")
    write_table()


if __name__ == "__main__":
    main()
