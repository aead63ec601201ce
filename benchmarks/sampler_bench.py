"""Rollout engine vs the static-batch sampler vs transformers ``generate``, side by side.

    python benchmarks/sampler_bench.py [--shape tiny|100m] [--batch 64] [--repeat 3]
        [--median 16] [--sigma 1.0] [--max-new 128] [--slots 8 16 32] [--equal-new 64]
        [--dtype float32|auto]

One random jaxrl model is written with ``save_pretrained`` and loaded by transformers
(``LlamaForCausalLM``, sdpa, fp32), so all three decode the same weights, greedily, from the same
B prompts (random ids, ``--prompt-len`` 16-48 tokens); jaxrl's two run in fp32, or with
``--dtype auto`` in the shipped configs' precision (bf16 matmul operands on a CPU with bf16
matmul instructions, so their greedy tokens may part from HF's fp32 ones after a near-tie). Cases:

- ``long-tail``: request b may generate ``limit[b]`` tokens, log-normal (median ``--median``,
  sigma ``--sigma``) with the largest forced to ``--max-new`` (>= 8x the median); eos is
  disabled (the eos embedding row is zeroed, so its logit 0 never wins the argmax over 32k random
  logits). The engine (``Sampler``) takes the per-request limits and ``--slots`` decode slots; the
  static sampler (``StaticSampler``) and HF ``generate`` cannot stop a row at its own limit, so
  they decode every row to the largest limit. Useful tokens = sum of the limits, for all three.
- ``grouped``: the same limits on GRPO-shaped prompts, B / G distinct prompts x G completions
  (``--group``): the engine prefills each prompt once, the others once per row.
- ``equal``: every request generates ``--equal-new`` tokens (no eos); engine with its default
  slots (one per request) vs the static sampler vs HF.

The engine compacts its decode steps (``compact_slots``, docs/rollout.md) as shipped;
``--uncompacted`` adds rows where every step runs all its slots, ``--unpacked`` rows with one
prompt per prefill row.

Calls are interleaved (engine configs, static, HF, then again) after one warm-up call each
(jaxrl compiles), ``--repeat`` times; each time is one whole ``generate`` call (prefill
included). The greedy tokens of every method are compared within each request's limit.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle torch threads sleep (shared cores)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import flax.nnx as nnx  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from machine import machine  # noqa: E402
from static_sampler import StaticSampler  # noqa: E402

from jaxrl.generate.sampler import Sampler, SamplingParams  # noqa: E402
from jaxrl.models.hf import save_pretrained  # noqa: E402
from jaxrl.models.model_config import ModelConfig  # noqa: E402
from jaxrl.models.transformer import Transformer  # noqa: E402
from jaxrl.train.precision import auto_compute_dtype, auto_matmul_dtype  # noqa: E402

SHAPES = {
    "tiny": dict(
        vocab_size=256, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=384,
    ),
    "100m": dict(
        vocab_size=32000, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
        num_key_value_heads=4, intermediate_size=2048,
    ),
}  # fmt: skip
PAD, EOS = 0, 1
GREEDY = SamplingParams(temperature=0.0)


def hf_generate(
    model, prompts: list[np.ndarray], new_tokens: int, device: str = "cpu"
) -> np.ndarray:
    """Greedy transformers ``generate`` on left-padded prompts, no eos: ``[B, new_tokens]``
    (the model and the inputs on torch ``device``)."""
    width = max(len(p) for p in prompts)
    ids = np.full((len(prompts), width), PAD, np.int64)
    mask = np.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - len(p) :], mask[b, width - len(p) :] = p, 1
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.as_tensor(ids, device=device),
            attention_mask=torch.as_tensor(mask, device=device),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=PAD,
        )
    return out[:, width:].cpu().numpy()


def bench_model(shape: str, dtype: str) -> tuple[ModelConfig, Transformer]:
    """The benchmark's random model of ``shape`` (fp32 weights, the eos embedding row zeroed so
    its logit 0 never wins the argmax) and the config jaxrl runs it in: fp32, or with ``auto``
    the shipped precision (``model.dtype: auto``)."""
    config = ModelConfig.tiny(**SHAPES[shape])
    model = Transformer(config, rngs=nnx.Rngs(0))
    if dtype == "auto":  # the same fp32 weights, run in the shipped precision
        config = dataclasses.replace(
            config, dtype=auto_compute_dtype("auto"), matmul_dtype=auto_matmul_dtype(None, "auto")
        )
    model.embedding[...] = model.embedding[...].at[EOS].set(0.0)  # eos logit 0: never argmax
    return config, model


def bench_prompts(rng, vocab_size: int, batch: int, prompt_len: Sequence[int]) -> list:
    """``batch`` random prompts of ``prompt_len`` = (min, max) tokens (ids 2.., no pad or eos)."""
    lengths = rng.integers(prompt_len[0], prompt_len[1] + 1, size=batch)
    return [rng.integers(2, vocab_size, size=n).astype(np.int32) for n in lengths]


def long_tail_limits(rng, batch: int, median: float, sigma: float, longest: int) -> np.ndarray:
    limits = np.exp(rng.normal(np.log(median), sigma, size=batch)).round().astype(np.int32)
    limits = np.clip(limits, 1, longest)
    limits[np.argmax(limits)] = longest  # the tail's end: max >= 8x median
    return limits


def run_case(name, methods, limits, repeat) -> dict:
    """Warm up, then time the methods round-robin; check their tokens agree within limits."""
    outs = {m: fn() for m, fn in methods.items()}  # warm-up (jaxrl compiles)
    times: dict[str, list[float]] = {m: [] for m in methods}
    for _ in range(repeat):
        for m, fn in methods.items():
            t0 = time.perf_counter()
            fn()
            times[m].append(time.perf_counter() - t0)
    ref = next(iter(outs.values()))
    useful = int(limits.sum())
    rows = {}
    for m, tokens in outs.items():
        same = np.mean([(tokens[b, :n] == ref[b, :n]).all() for b, n in enumerate(limits)])
        med = statistics.median(times[m])
        rows[m] = dict(
            median_s=med, min_s=min(times[m]), max_s=max(times[m]), tok_s=useful / med,
            rows_equal_to_first=float(same),
        )  # fmt: skip
    print(f"\n### {name}: B={len(limits)}, useful tokens {useful} (limits median "
          f"{int(np.median(limits))}, max {limits.max()}, mean {limits.mean():.1f})")  # fmt: skip
    header = "method | s/call median (min-max) | useful tokens/s | vs static | vs HF | rows equal"
    print(f"| {header} |")
    print("|---|---|---|---|---|---|")
    static = next(v["tok_s"] for k, v in rows.items() if k.startswith("static"))
    hf = rows.get("HF generate", {}).get("tok_s")
    for m, r in rows.items():
        vs_hf = f"{r['tok_s'] / hf:.2f}x" if hf else "-"
        print(f"| {m} | {r['median_s']:.2f} ({r['min_s']:.2f}-{r['max_s']:.2f}) | "
              f"{r['tok_s']:,.0f} | {r['tok_s'] / static:.2f}x | {vs_hf} | "
              f"{r['rows_equal_to_first']:.0%} |")  # fmt: skip
    return rows


def long_tail_arguments(
    ap: argparse.ArgumentParser, *, shape: str, median: float, max_new: int, dtype: str
) -> None:
    """The options that draw the long-tail case (model, prompts, limits; shared with
    long_tail_bound.py, which replays it) and time it, with these defaults."""
    ap.add_argument("--shape", choices=sorted(SHAPES), default=shape)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--median", type=float, default=median)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--max-new", type=int, default=max_new)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[16, 48], help="min max")
    ap.add_argument(
        "--dtype",
        choices=("float32", "auto"),
        default=dtype,
        help="jaxrl's compute: auto = as the shipped configs run (model.dtype: auto; on a CPU "
        "with AMX-BF16 or AVX512-BF16, bf16 matmul operands with fp32 accumulation); HF stays "
        "fp32",
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    long_tail_arguments(ap, shape="tiny", median=16, max_new=128, dtype="float32")
    ap.add_argument("--slots", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--equal-new", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument(
        "--unpacked",
        action="store_true",
        help="also time the engine with one prompt per prefill row",
    )
    ap.add_argument(
        "--uncompacted",
        action="store_true",
        help="also time the engine with every decode step over all its slots (compact_slots off)",
    )
    ap.add_argument("--cases", nargs="+", default=["long-tail", "grouped", "equal"])
    ap.add_argument("--group", type=int, default=8, help="G of the grouped case")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()

    config, model = bench_model(args.shape, args.dtype)
    hf_dir = Path(tempfile.mkdtemp(prefix="sampler_bench_")) / "hf"
    save_pretrained(model, hf_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, attn_implementation="sdpa", dtype=torch.float32
    ).eval()
    rng = np.random.default_rng(0)  # the prompts, then the long tail's limits
    distinct = bench_prompts(rng, config.vocab_size, args.batch, args.prompt_len)
    grouped = [p for p in distinct[: args.batch // args.group] for _ in range(args.group)]
    key = jax.random.key(0)
    print(json.dumps(machine(("jax", "jaxlib", "torch", "transformers"))))
    print(f"model {args.shape}: D={config.hidden_size} layers={config.num_hidden_layers} "
          f"V={config.vocab_size}, jaxrl compute {config.dtype} (matmul operands "
          f"{config.matmul_dtype or config.dtype}), HF fp32, greedy; "
          f"prompts {args.prompt_len} tokens")  # fmt: skip

    def engine(prompts, limits, slots, pack=True, compact=True):
        sampler = Sampler(config, max_new_tokens=int(limits.max()), eos_id=EOS, pad_id=PAD,
                          max_slots=slots, pack_prompts=pack, compact_slots=compact)  # fmt: skip
        sampler.load_params(model)
        return lambda: sampler.generate(prompts, key, GREEDY, max_tokens=limits).tokens

    def static(prompts, limits):
        sampler = StaticSampler(config, max_new_tokens=int(limits.max()), eos_id=EOS, pad_id=PAD)
        sampler.load_params(model)
        return lambda: sampler.generate(prompts, key, GREEDY).tokens

    def hf_fn(prompts, limits):
        return lambda: hf_generate(hf, prompts, int(limits.max()))

    tail = long_tail_limits(rng, args.batch, args.median, args.sigma, args.max_new)
    g = args.group
    cases = {
        "long-tail": (distinct, tail, args.slots, "distinct prompts"),
        "grouped": (grouped, tail, args.slots, f"{args.batch // g} prompts x G={g}"),
        "equal": (distinct, np.full(args.batch, args.equal_new, np.int32), [0], "distinct"),
    }
    results = {}
    for name in args.cases:
        prompts, limits, slots, what = cases[name]
        methods = {f"engine, {s or 'one per request'} slots": engine(prompts, limits, s)
                   for s in slots}  # fmt: skip
        if args.unpacked:
            for s in slots:
                methods[f"engine, {s or 'one per request'} slots, unpacked"] = engine(
                    prompts, limits, s, pack=False
                )
        if args.uncompacted:
            for s in slots:
                methods[f"engine, {s or 'one per request'} slots, uncompacted"] = engine(
                    prompts, limits, s, compact=False
                )
        methods["static sampler"] = static(prompts, limits)
        if not args.skip_hf:
            methods["HF generate"] = hf_fn(prompts, limits)
        results[name] = run_case(f"{name} ({what})", methods, limits, args.repeat)
    print(f"\nload average after: {os.getloadavg()}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
