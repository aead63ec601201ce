"""Decode throughput of jaxrl's KV-cache ``Sampler`` vs transformers ``generate``, same model.

    python benchmarks/sampler_bench.py [--shape tiny|100m] [--batch 64] [--new-tokens 64]

One random jaxrl model is written with ``save_pretrained`` and loaded by transformers
(``LlamaForCausalLM``, sdpa), so both decode the same weights. Both get the same B prompts
(random ids, lengths uniform in ``[--min-prompt, --max-prompt]``), left-padded, and decode
greedily up to ``--new-tokens`` tokens (eos = 1, pad = 0; prompts never contain either).
Calls alternate (jaxrl, HF, jaxrl, ...) after one warm-up call each (jaxrl's compiles), and each
side's time is the whole ``generate`` call (prefill included). Decode tokens/s = B x decode steps
/ time. The greedy completions of the two are compared token by token.

Then the sampler's compile contract: a call with a smaller batch, one with other prompt lengths
in the same prompt bucket, and one with other sampling parameters, counting ``compiles``; and the
KV cache's dtype with a bfloat16 compute dtype (``jax.eval_shape`` of the prefill).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle torch threads sleep (shared cores)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flax.nnx as nnx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from jaxrl.models.hf import save_pretrained  # noqa: E402
from jaxrl.models.model_config import ModelConfig  # noqa: E402
from jaxrl.models.transformer import Transformer  # noqa: E402
from jaxrl.rollout.sampler import Sampler, SamplingParams, prefill  # noqa: E402

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


def hf_generate(model, prompts: list[np.ndarray], new_tokens: int) -> np.ndarray:
    """Greedy transformers ``generate`` on left-padded prompts; the new tokens ``[B, <=N]``."""
    width = max(len(p) for p in prompts)
    ids = np.full((len(prompts), width), PAD, np.int64)
    mask = np.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - len(p) :], mask[b, width - len(p) :] = p, 1
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.as_tensor(ids),
            attention_mask=torch.as_tensor(mask),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=EOS,
            pad_token_id=PAD,
        )
    return out[:, width:].numpy()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--min-prompt", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=48)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()

    config = ModelConfig.tiny(**SHAPES[args.shape])
    model = Transformer(config, rngs=nnx.Rngs(0))
    hf_dir = Path(tempfile.mkdtemp(prefix="sampler_bench_")) / "hf"
    save_pretrained(model, hf_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, attn_implementation="sdpa", dtype=torch.float32
    ).eval()

    rng = np.random.default_rng(0)
    lengths = rng.integers(args.min_prompt, args.max_prompt + 1, size=args.batch)
    prompts = [rng.integers(2, config.vocab_size, size=n).astype(np.int32) for n in lengths]
    sampler = Sampler(config, max_new_tokens=args.new_tokens, eos_id=EOS, pad_id=PAD)
    sampler.load_params(model)
    key = jax.random.key(0)

    def run_jaxrl():
        return sampler.generate(prompts, key, GREEDY)

    def run_hf():
        return hf_generate(hf, prompts, args.new_tokens)

    ours, theirs = run_jaxrl(), run_hf()  # warm-up (jaxrl compiles)
    times: dict[str, list[float]] = {"jaxrl Sampler": [], "HF generate": []}
    for _ in range(args.repeat):
        for name, fn in (("jaxrl Sampler", run_jaxrl), ("HF generate", run_hf)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)

    steps = {"jaxrl Sampler": ours.num_steps, "HF generate": theirs.shape[1]}
    n = min(ours.tokens.shape[1], theirs.shape[1])
    same = float(np.mean(ours.tokens[:, :n] == theirs[:, :n]))
    print(
        f"jax {jax.__version__}, torch {torch.__version__} ({torch.get_num_threads()} threads), "
        f"transformers {transformers.__version__}; load average {os.getloadavg()[0]:.2f}; "
        f"model {args.shape}: D={config.hidden_size} L={config.num_hidden_layers} "
        f"V={config.vocab_size}; B={args.batch}, prompts {args.min_prompt}-{args.max_prompt} "
        f"tokens (left-padded to the next power of two), max_new_tokens={args.new_tokens}"
    )
    print("| sampler | decode steps | s/call median (min-max) | decode tokens/s |")
    medians = {}
    for name, ts in times.items():
        med = medians[name] = statistics.median(ts)
        rate = args.batch * steps[name] / med
        print(f"| {name} | {steps[name]} | {med:.3f} ({min(ts):.3f}-{max(ts):.3f}) | {rate:,.0f} |")
    ratio = (args.batch * steps["jaxrl Sampler"] / medians["jaxrl Sampler"]) / (
        args.batch * steps["HF generate"] / medians["HF generate"]
    )
    print(f"jaxrl / HF decode tokens/s = {ratio:.2f}; greedy tokens equal: {same:.1%}")

    # compile contract: one program per (B, P bucket, N); sampling parameters are traced
    before = sampler.compiles
    bucket = 1 << (int(max(lengths)) - 1).bit_length()
    shorter = [p[: bucket // 2 + 1] for p in prompts]  # longest now bucket/2 + 1: same bucket
    sampler.generate(shorter, key, GREEDY)
    same_bucket = sampler.compiles - before
    sampler.generate(prompts, key, SamplingParams(temperature=0.7, top_k=20, top_p=0.9))
    sampling = sampler.compiles - before - same_bucket
    sampler.generate(prompts[: args.batch - 4], key, GREEDY)
    smaller = sampler.compiles - before - same_bucket - sampling
    print(
        f"compiles: first call 1; shorter prompts, same bucket {bucket} (longest "
        f"{max(lengths)} -> {bucket // 2 + 1}) +{same_bucket}; other sampling parameters "
        f"+{sampling}; "
        f"batch {args.batch} -> {args.batch - 4} +{smaller}"
    )
    bf16 = ModelConfig.tiny(**SHAPES[args.shape], dtype="bfloat16")
    tokens = jnp.zeros((2, 8), jnp.int32)
    abstract = nnx.eval_shape(lambda: Transformer(bf16, rngs=nnx.Rngs(0)))
    _, cache = jax.eval_shape(lambda m: prefill(m, tokens, jnp.full((2,), 8), 16), abstract)
    print(f"KV cache dtype with param_dtype float32, dtype bfloat16: {cache.keys.dtype}")


if __name__ == "__main__":
    main()
