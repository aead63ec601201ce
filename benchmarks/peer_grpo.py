"""jaxrl GRPO vs Hugging Face TRL's GRPOTrainer, side by side, from the same SFT warm start.

    pip install -r benchmarks/requirements-peer.txt
    python benchmarks/peer_grpo.py [--config configs/grpo_tiny.yaml] [--seeds 0 1] [--steps N]
        [--out runs/peer_grpo] [--set KEY=VALUE ...] [--cpus N] [--eval-samples K]

Per seed, each stage in its own process (so CPU accounting and thread pools never mix):

1. ``jaxrl``: the config's SFT warm start (``jaxrl.trainers.warm_start``, exported as a HF
   directory: config.json, safetensors, the character tokenizer), then jaxrl's ``GRPOTrainer``
   from it for N steps (default: the config's ``max_steps``). Writes the settings it actually
   used (GRPO fields, the GRPO-stage optimizer, its learning rate per step, the training
   problems) for the TRL stage.
2. ``trl``: TRL's ``GRPOTrainer`` from the same HF directory with the same settings: prompts and
   their order (TRL's sampler is replaced by one that draws jaxrl's ``PromptSampler`` order, i.e.
   ``repeat_sampler_indices``: TRL's ``RepeatSampler`` has the same structure but draws its
   permutation with torch), reward functions and weights, batch / group / generation sizes, loss,
   clipping, AdamW (b1, b2, eps, weight decay: jaxrl decays tensors of rank >= 2, the HF Trainer
   all but biases and norms, the same tensors here), gradient clipping and the learning rate of
   every step (a ``LambdaLR`` over jaxrl's schedule). Prompt ids are ``[bos] + characters`` in
   both (a post-processor on TRL's tokenizer, asserted). fp32, CPU.
3. ``eval``: one evaluator for the warm start and both final models: each HF directory is loaded
   with ``jaxrl.models.from_pretrained`` and scored by ``jaxrl.rollout.heldout.HeldoutEvaluator``
   on the task's held-out problems (greedy exact match, and k samples per prompt at the training
   temperature with the same random bits for every model).

Timing covers the optimizer steps only (generation, rewards, loss, update; not evaluation or
checkpointing): wall seconds and process CPU seconds (``getrusage``, all threads) per step, the
first step (compilation, lazy set-up) reported apart. What still differs between the two runs:
the random streams (JAX vs torch sampling, so different completions from the first step on),
each framework's fp32 numerics (packed rows vs padded batches), and, only when
steps_per_generation > 1, which rows of a generation form each micro-step (both shuffle the
generation once, jaxrl with numpy, TRL with torch). The stages run with
``OMP_WAIT_POLICY=PASSIVE`` unless it is set: with torch's spin-waiting threads a busy machine
makes TRL's steps many times slower (see ``CONTENDED``).

Everything goes to ``<out>/peer_grpo.json``; ``<out>/seed<S>/`` holds the runs.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from harness import run_fresh, seconds_per_step
from machine import machine as describe_machine
from trl_peer import SHARED_GRPO_FIELDS, cpu_seconds, same_schedule_trainer

# torch's OpenMP threads spin-wait by default; while other processes hold the cores that made
# TRL's steps up to 15x slower on a 2-core machine (jaxrl's XLA thread pool is not affected).
# Unless the caller sets it, every stage runs with threads that sleep while they wait.
OMP_WAIT_POLICY = os.environ.get("OMP_WAIT_POLICY", "PASSIVE")
CONTENDED = (
    f"other processes were running and OMP_WAIT_POLICY={OMP_WAIT_POLICY}: torch's OpenMP threads "
    "spin-wait under contention (up to 15x slower steps); rerun on an idle machine, or with "
    "OMP_WAIT_POLICY=PASSIVE (the default here) or --cpus 1"
)
FIRST_LAST = 10  # training reward: mean of the first and of the last this many steps


def recording(fn: Any, log: list[list[str]], num_generations: int) -> Any:
    """``fn`` (a TRL-style reward function, name kept) that also logs each batch's prompts
    (one per group)."""

    @functools.wraps(fn)
    def wrapped(prompts, completions, **columns):
        log.append(list(prompts)[::num_generations])
        return fn(prompts, completions, **columns)

    return wrapped


# -- stage 1: warm start and jaxrl GRPO ------------------------------------------------------------
def stage_jaxrl(job: dict[str, Any]) -> dict[str, Any]:
    import dataclasses

    from jaxrl.config import load_run_config, to_dict
    from jaxrl.rollout.rewards.compute import reward_name
    from jaxrl.rollout.rewards.specs import resolve_reward_funcs
    from jaxrl.train.optimizer import learning_rate_schedule
    from jaxrl.train.run_io.metrics import read_metrics
    from jaxrl.trainers.grpo import DEFAULT_REWARD_FUNCS, GRPOTrainer
    from jaxrl.trainers.warm_start import warm_start

    seed_dir = Path(job["seed_dir"])
    sets = [f"seed={job['seed']}", f"output_dir={seed_dir / 'warm'}", "logging.progress=false"]
    if job["steps"]:
        sets.append(f"max_steps={job['steps']}")
    cfg = load_run_config(job["config"], [*sets, *job["set"]])
    if cfg.algorithm != "grpo":
        raise SystemExit(f"{job['config']}: algorithm={cfg.algorithm!r}, expected grpo")
    if cfg.mesh.data != 1 or cfg.schedule.docs_per_step or cfg.model.param_dtype != "float32":
        raise SystemExit("the comparison needs mesh.data=1, docs_per_step=0 and float32 params")
    t0 = time.perf_counter()
    cfg = warm_start(cfg)  # SFT into <seed_dir>/warm/sft; cfg.model.path = its HF export
    warm_s = time.perf_counter() - t0
    cfg = dataclasses.replace(cfg, output_dir=str(seed_dir / "jaxrl"))

    prompt_log: list[list[str]] = []
    funcs = resolve_reward_funcs(DEFAULT_REWARD_FUNCS)  # jaxrl's defaults, as `jaxrl train`
    funcs[0] = recording(funcs[0], prompt_log, cfg.grpo.num_generations)
    trainer = GRPOTrainer(cfg, reward_funcs=funcs)
    steps: list[dict[str, float]] = []
    step = trainer.step

    def timed_step() -> dict[str, Any]:
        w0, c0 = time.perf_counter(), cpu_seconds()
        row = step()
        steps.append({"wall_s": time.perf_counter() - w0, "cpu_s": cpu_seconds() - c0})
        return row

    trainer.step = timed_step  # run() calls self.step() once per optimizer step
    summary = trainer.run()
    rows = [r for r in read_metrics(trainer.session.writer.path) if "reward" in r]
    c, opt = trainer.config, trainer.cfg.optimizer  # what the run used (GRPO-stage optimizer)
    schedule = learning_rate_schedule(opt, trainer.cfg.max_steps)
    exs = trainer.train_examples
    return {
        "warm_start": cfg.model.path,
        "warm_start_s": warm_s,
        "hf": summary["hf_export"],
        "summary": summary,
        "rows": rows,
        "steps": steps,
        "prompts": prompt_log,
        "settings": {
            "seed": trainer.cfg.seed,
            "max_steps": trainer.cfg.max_steps,
            "grpo": {k: getattr(c, k) for k in (*SHARED_GRPO_FIELDS, "top_k")},
            "optimizer": to_dict(opt),
            "lr": [float(schedule(k)) for k in range(trainer.cfg.max_steps)],
            "reward_funcs": [reward_name(f) for f in funcs],
            "train": {"prompt": [e.prompt for e in exs], "answer": [e.answer for e in exs]},
            "eval": {
                "prompt": [e.prompt for e in trainer.eval_examples],
                "answer": [e.answer for e in trainer.eval_examples],
            },
            "eval_samples": trainer.cfg.logging.eval_samples,
            "prompt_ids": [trainer.tokenizer.encode(e.prompt, add_bos=True) for e in exs[:16]],
        },
    }


# -- stage 2: TRL GRPO ---------------------------------------------------------------------------
def hf_tokenizer(path: str) -> Any:
    """The exported character tokenizer as a transformers tokenizer that prepends bos, as jaxrl
    does (``encode(prompt, add_bos=True)``); TRL tokenises string prompts with the defaults."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    special = json.loads((Path(path) / "tokenizer_config.json").read_text())
    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(Path(path) / "tokenizer.json"),
        bos_token=special["bos_token"],
        eos_token=special["eos_token"],
        pad_token=special.get("pad_token", special["eos_token"]),
        padding_side="left",
    )
    bos = tok.bos_token
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, tok.bos_token_id)]
    )
    return tok


def stage_trl(job: dict[str, Any]) -> dict[str, Any]:
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from jaxrl.rollout.rewards.specs import resolve_reward_funcs

    jx = json.loads((Path(job["seed_dir"]) / "jaxrl.json").read_text())
    s, g = jx["settings"], jx["settings"]["grpo"]
    opt, lr = s["optimizer"], s["lr"]
    warm = jx["warm_start"]

    tok = hf_tokenizer(warm)
    got = tok(text=s["train"]["prompt"][:16])["input_ids"]
    assert got == s["prompt_ids"], f"TRL's prompt ids {got[:2]} != jaxrl's {s['prompt_ids'][:2]}"
    model = AutoModelForCausalLM.from_pretrained(warm, dtype=torch.float32)
    gc = model.generation_config  # the export has none: name the special tokens
    gc.bos_token_id, gc.eos_token_id = tok.bos_token_id, tok.eos_token_id
    gc.pad_token_id = tok.pad_token_id

    prompt_log: list[list[str]] = []
    funcs = resolve_reward_funcs(s["reward_funcs"])  # the same callables
    funcs[0] = recording(funcs[0], prompt_log, g["num_generations"])
    trl_dir = Path(job["seed_dir"]) / "trl"
    trainer, steps = same_schedule_trainer(
        grpo=g,
        optimizer=opt,
        lr=lr,
        seed=s["seed"],
        max_steps=s["max_steps"],
        output_dir=str(trl_dir / "trainer"),
        model=model,
        reward_funcs=funcs,
        train_dataset=Dataset.from_dict(s["train"]),
        processing_class=tok,
    )
    trainer.train()
    trainer.save_model(str(trl_dir / "hf"))
    rows = [r for r in trainer.state.log_history if "reward" in r]
    return {
        "hf": str(trl_dir / "hf"),
        "cpus": len(os.sched_getaffinity(0)),
        "rows": rows,
        "steps": steps,
        "prompts": prompt_log,
        "torch_threads": torch.get_num_threads(),
        "versions": {"trl": trl.__version__, "torch": torch.__version__},
    }


# -- stage 3: one evaluator for every model ------------------------------------------------------
def stage_eval(job: dict[str, Any]) -> dict[str, Any]:
    from jaxrl.data.tokenizer import load_tokenizer
    from jaxrl.generate.sampler import SamplingParams
    from jaxrl.models import from_pretrained
    from jaxrl.rollout.heldout import HeldoutEvaluator

    seed_dir = Path(job["seed_dir"])
    jx = json.loads((seed_dir / "jaxrl.json").read_text())
    tr = json.loads((seed_dir / "trl.json").read_text())
    s, g = jx["settings"], jx["settings"]["grpo"]
    tok = load_tokenizer(jx["warm_start"])  # the tokenizer both runs trained with
    assert [tok.encode(p, add_bos=True) for p in s["train"]["prompt"][:16]] == s["prompt_ids"]
    k = job["eval_samples"] if job["eval_samples"] is not None else s["eval_samples"] or 8
    sampling = SamplingParams(temperature=g["temperature"], top_k=g["top_k"] or 0, top_p=g["top_p"])
    out = {}
    for name, path in (("start", jx["warm_start"]), ("jaxrl", jx["hf"]), ("trl", tr["hf"])):
        model = from_pretrained(path)
        evaluator = HeldoutEvaluator(
            model.config,
            tok,
            s["eval"]["prompt"],
            s["eval"]["answer"],
            max_new_tokens=g["max_completion_length"],
            sampling=sampling,
            samples_per_prompt=k,
            seed=s["seed"],  # the same random bits for every model
        )
        res = evaluator(model)
        out[name] = {"greedy": res.greedy, "sampled": res.sampled}
    out["samples_per_prompt"] = k
    return out


STAGES = {"jaxrl": stage_jaxrl, "trl": stage_trl, "eval": stage_eval}


def run_stage(name: str, job: dict[str, Any]) -> dict[str, Any]:
    """Run one stage in a fresh interpreter (``harness.run_fresh``); its result is
    ``<seed_dir>/<name>.json``. Both frameworks size their thread pools to the CPUs pinned."""
    seed_dir = Path(job["seed_dir"])
    args = [__file__, "--stage", name, "--job", str(seed_dir / "job.json")]
    timing = run_fresh(
        args, job, seed_dir / "job.json", seed_dir / f"{name}.log",
        env={"OMP_WAIT_POLICY": OMP_WAIT_POLICY}, cpus=job["cpus"] or None,
    )  # fmt: skip
    load = timing["load_before"]
    print(f"  {name}: {timing['wall_s']:.0f} s (load average {load:.1f} before)", flush=True)
    if name == "trl" and load > 1 and OMP_WAIT_POLICY.upper() != "PASSIVE":
        print(f"  warning: {CONTENDED}", flush=True)
    return json.loads((seed_dir / f"{name}.json").read_text()) | {"load_before": load}


# -- the report ----------------------------------------------------------------------------------
def per_step(steps: list[dict[str, float]], key: str) -> float | None:
    """``harness.seconds_per_step`` of one per-step measurement (median after the first)."""
    return seconds_per_step([s[key] for s in steps])


def framework_numbers(run: dict[str, Any], ev: dict[str, Any], exact_key: str) -> dict[str, Any]:
    rewards = [r["reward"] for r in run["rows"]]
    exact = [r[exact_key] for r in run["rows"]]
    n = min(FIRST_LAST, len(rewards))
    return {
        "steps": len(rewards),
        "reward_first": statistics.fmean(rewards[:n]),
        "reward_last": statistics.fmean(rewards[-n:]),
        "exact_first": statistics.fmean(exact[:n]),
        "exact_last": statistics.fmean(exact[-n:]),
        "sampled_start": ev["start"]["sampled"],
        "greedy_start": ev["start"]["greedy"],
        "sampled_end": ev["end"]["sampled"],
        "greedy_end": ev["end"]["greedy"],
        "s_per_step": per_step(run["steps"], "wall_s"),
        "cpu_s_per_step": per_step(run["steps"], "cpu_s"),
        "first_step_s": run["steps"][0]["wall_s"],
        "reward_per_step": rewards,
        "lr_per_step": [r.get("learning_rate") for r in run["rows"]],
        "step_times": run["steps"],
    }


ROWS = [  # (label, key, format)
    ("train reward, first {n} steps", "reward_first", "{:.3f}"),
    ("train reward, last {n} steps", "reward_last", "{:.3f}"),
    ("train exact-answer reward, first {n}", "exact_first", "{:.3f}"),
    ("train exact-answer reward, last {n}", "exact_last", "{:.3f}"),
    ("held-out sampled acc., start", "sampled_start", "{:.1%}"),
    ("held-out sampled acc., end", "sampled_end", "{:.1%}"),
    ("held-out greedy acc., start", "greedy_start", "{:.1%}"),
    ("held-out greedy acc., end", "greedy_end", "{:.1%}"),
    ("s / step (after the first)", "s_per_step", "{:.2f}"),
    ("CPU s / step (after the first)", "cpu_s_per_step", "{:.2f}"),
    ("first step s", "first_step_s", "{:.1f}"),
]


def table(columns: dict[str, dict[str, Any]], n: int) -> str:
    names = list(columns)
    lines = ["| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for label, key, fmt in ROWS:
        cells = [fmt.format(columns[c][key]) if columns[c][key] is not None else "–" for c in names]
        lines.append(f"| {label.format(n=n)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    return {
        **describe_machine(("jax", "flax", "torch", "transformers", "trl")),
        "OMP_WAIT_POLICY": OMP_WAIT_POLICY,
    }


def compare(jx: dict[str, Any], tr: dict[str, Any], ev: dict[str, Any]) -> dict[str, Any]:
    """One seed's numbers per framework, and checks that the two runs were set up alike."""
    exact = {"jaxrl": "rewards/exact_answer/mean", "TRL": "rewards/exact_answer_reward/mean"}
    cols = {
        "jaxrl": framework_numbers(jx, {**ev, "end": ev["jaxrl"]}, exact["jaxrl"]),
        "TRL": framework_numbers(tr, {**ev, "end": ev["trl"]}, exact["TRL"]),
    }
    lr_j, lr_t = cols["jaxrl"]["lr_per_step"], cols["TRL"]["lr_per_step"]
    same_steps = len(lr_j) == len(lr_t) == jx["settings"]["max_steps"]
    checks = {
        "same_prompt_order": jx["prompts"] == tr["prompts"],
        "same_steps": same_steps,
        "same_lr": same_steps  # to float32 precision
        and all(abs(a - b) <= 1e-5 * abs(a) + 1e-12 for a, b in zip(lr_j, lr_t, strict=True)),
        # the shared evaluator reproduces jaxrl's own evaluations of the start and the end
        "eval_matches_jaxrl": all(
            ev[model][kind] == jx["summary"].get(f"eval/{metric}{suffix}")
            for model, suffix in (("start", "_start"), ("jaxrl", ""))
            for kind, metric in (("greedy", "accuracy"), ("sampled", "accuracy_sampled"))
            if kind == "greedy" or ev["samples_per_prompt"] == jx["settings"]["eval_samples"]
        ),
    }
    return {
        "columns": cols,
        "checks": checks,
        "settings": {
            k: v for k, v in jx["settings"].items() if k not in ("train", "eval", "prompt_ids")
        },
        "warm_start_s": jx["warm_start_s"],
        "eval_samples_per_prompt": ev["samples_per_prompt"],
        "torch_threads": tr["torch_threads"],
        "cpus": tr["cpus"],
        "load_average_before": {"jaxrl": jx["load_before"], "TRL": tr["load_before"]},
    }


def over_seeds(runs: dict[int, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Mean and min over seeds of every table row, per framework."""
    summary = {}
    for name in ("jaxrl", "TRL"):
        for agg, fn in (("mean", statistics.fmean), ("min", min)):
            values = {key: [r["columns"][name][key] for r in runs.values()] for _, key, _ in ROWS}
            summary[f"{name} {agg}"] = {
                key: None if None in xs else fn(xs) for key, xs in values.items()
            }
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/grpo_tiny.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--steps", type=int, default=0, help="GRPO steps (0: max_steps)")
    parser.add_argument("--out", default="runs/peer_grpo")
    parser.add_argument("--set", action="append", default=[], help="config override KEY=VALUE")
    parser.add_argument("--eval-samples", type=int, default=None, help="k (default: config's)")
    parser.add_argument(
        "--cpus", type=int, default=0, help="pin every stage to the first N CPUs (0: all)"
    )
    parser.add_argument(
        "--reuse-warm-start",
        action="store_true",
        help="keep <out>/seed<S>/warm if present (even if the config changed)",
    )
    parser.add_argument("--stage", choices=sorted(STAGES), help=argparse.SUPPRESS)
    parser.add_argument("--job", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.stage:  # a worker process
        job = json.loads(Path(args.job).read_text())
        result = STAGES[args.stage](job)
        (Path(job["seed_dir"]) / f"{args.stage}.json").write_text(json.dumps(result, indent=1))
        return

    out = Path(args.out).resolve()
    info = machine()
    load = info["load_average"][0]
    print(f"machine: nproc {info['nproc']} ({info['cpu']}), load average {load:.1f}")
    print(f"OMP_WAIT_POLICY={OMP_WAIT_POLICY}, {info['versions']}")
    runs = {}
    for seed in args.seeds:
        seed_dir = out / f"seed{seed}"
        for sub in ("jaxrl", "trl") if args.reuse_warm_start else ("",):
            shutil.rmtree(seed_dir / sub, ignore_errors=True)
        seed_dir.mkdir(parents=True, exist_ok=True)
        job = {
            "config": str(Path(args.config).resolve()),
            "seed": seed,
            "steps": args.steps,
            "set": args.set,
            "seed_dir": str(seed_dir),
            "eval_samples": args.eval_samples,
            "cpus": sorted(os.sched_getaffinity(0))[: args.cpus] if args.cpus else None,
        }
        print(f"seed {seed}:", flush=True)
        jx = run_stage("jaxrl", job)
        tr = run_stage("trl", job)
        ev = run_stage("eval", job)
        runs[seed] = run = compare(jx, tr, ev)
        n = min(FIRST_LAST, run["columns"]["jaxrl"]["steps"])
        cpus = f"{run['cpus']} CPUs, torch threads {run['torch_threads']}"
        print(f"\n### seed {seed} ({run['settings']['max_steps']} GRPO steps, {cpus})\n")
        print(table(run["columns"], n) + "\n")
        print("checks: " + ", ".join(f"{k}={v}" for k, v in run["checks"].items()) + "\n")

    summary = over_seeds(runs) if len(runs) > 1 else {}
    if summary:
        n = min(FIRST_LAST, min(r["columns"]["jaxrl"]["steps"] for r in runs.values()))
        print(f"### over seeds {args.seeds}\n\n{table(summary, n)}\n")
    record = {"machine": info, "config": args.config, "set": args.set, "cpus": args.cpus}
    record |= {"runs": runs, "over_seeds": summary}
    (out / "peer_grpo.json").write_text(json.dumps(record, indent=1))
    print(f"wrote {out / 'peer_grpo.json'}")


if __name__ == "__main__":
    main()
