"""What a decode step's matmuls cost on this machine, by the rows they carry: the floor under the
rollout engine's long-tail speed-up (benchmarks/README.md, "the long tail: what bounds it").

    python benchmarks/decode_matmul_bound.py [--pairs 48] [--rows 1 2 4 ... 512] [--riding 64 256]
        [--repeat 5] [--read-mb 400]

A stack of ``--pairs`` MLP-like matmul pairs ``x @ W [D, I]``, then ``@ V [I, D]`` (D, I of
``sampler_bench.py``'s 100m shape: 768, 2048), every pair its own weights, so each call streams
all of them from memory as a decode step streams a model's (48 pairs in bf16: 302 MB; the 100m
model's body is 151 MB in bf16 and its fp32 head 98 MB). Printed, each the median of
``--repeat`` calls after a warm-up call:

- the machine's read bandwidth (``jnp.sum`` of a 400 MB float32 array);
- the stack's time at each row count M (bf16 operands with fp32 accumulation, as the shipped
  configs run on a CPU with bf16 instructions, and float32), with the weights' streaming rate
  and the arithmetic rate, and a least-squares fit ``time = a + b * M`` over M >= 16: ``a`` is
  what every step pays whatever its rows (reading the weights), ``b`` what a row costs;
- rows riding along: the stack on 16 rows and on P rows as two calls, as two independent
  computations in one program, and as one call on the 16 + P rows concatenated (a decode step
  carrying P prefill tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from harness import median_call  # noqa: E402
from machine import machine  # noqa: E402
from sampler_bench import SHAPES  # noqa: E402


def stack(weights, dtype):
    """``x -> x + sum_k relu(x @ W_k) @ V_k * 1e-3`` over the pairs, one after the other."""

    def run(x):
        for w, v in weights:
            h = jnp.dot(x.astype(dtype), w, preferred_element_type=jnp.float32)
            y = jnp.dot(jax.nn.relu(h).astype(dtype), v, preferred_element_type=jnp.float32)
            x = x + y * 1e-3
        return x

    return run


def timed(fn, *args, repeat: int) -> float:
    """Median seconds of ``fn(*args)`` (jitted, waited for), after a warm-up call."""
    return median_call(lambda: jax.block_until_ready(fn(*args)), repeat)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=48)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512])
    ap.add_argument("--riding", type=int, nargs="+", default=[64, 256], help="P prefill rows")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--read-mb", type=int, default=400, help="array read for the bandwidth")
    args = ap.parse_args()
    d, i = SHAPES["100m"]["hidden_size"], SHAPES["100m"]["intermediate_size"]
    rng = np.random.default_rng(0)
    print(json.dumps(machine(("jax", "jaxlib"))))

    big = jnp.asarray(rng.standard_normal(args.read_mb * 250_000, dtype=np.float32))
    read_gbs = args.read_mb / 1e3 / timed(jax.jit(jnp.sum), big, repeat=args.repeat)
    del big
    print(f"read bandwidth (sum of {args.read_mb} MB): {read_gbs:.1f} GB/s")
    report: dict = {"read_GBs": read_gbs, "stack": {}, "riding": {}}

    for dtype in (jnp.bfloat16, jnp.float32):
        name = jnp.dtype(dtype).name
        weights = [
            (
                jnp.asarray(rng.standard_normal((d, i), dtype=np.float32), dtype),
                jnp.asarray(rng.standard_normal((i, d), dtype=np.float32), dtype),
            )
            for _ in range(args.pairs)
        ]
        nbytes = 2 * args.pairs * d * i * jnp.dtype(dtype).itemsize
        f = stack(weights, dtype)
        run = jax.jit(f)
        print(f"\n{name}: {args.pairs} pairs, {nbytes / 1e6:.0f} MB of weights")
        print("| rows M | ms per stack | weights GB/s | GFLOP/s |\n|---|---|---|---|")
        times = {}
        for m in args.rows:
            x = jnp.asarray(rng.standard_normal((m, d), dtype=np.float32))
            times[m] = timed(run, x, repeat=args.repeat)
            flops = 4 * args.pairs * d * i * m
            print(f"| {m} | {times[m] * 1e3:.1f} | {nbytes / times[m] / 1e9:.1f} | "
                  f"{flops / times[m] / 1e9:.0f} |", flush=True)  # fmt: skip
        fit_m = [m for m in times if m >= 16]
        b, a = np.polyfit(fit_m, [times[m] for m in fit_m], 1)
        print(f"fit over M >= 16: time = {a * 1e3:.1f} ms + {b * 1e3:.3f} ms per row")
        report["stack"][name] = {"ms": {m: t * 1e3 for m, t in times.items()},
                                 "a_ms": a * 1e3, "b_ms_per_row": b * 1e3}  # fmt: skip
        if dtype != jnp.bfloat16:
            continue
        decode = jnp.asarray(rng.standard_normal((16, d), dtype=np.float32))
        both = jax.jit(lambda x, y: (f(x), f(y)))  # noqa: B023  (used within this iteration)
        joined = jax.jit(lambda x, y: f(jnp.concatenate([x, y])))  # noqa: B023
        print("\n| P | 16 rows, then P rows (two calls) | both in one program | 16 + P rows "
              "in one call |\n|---|---|---|---|")  # fmt: skip
        for p in args.riding:
            prefill = jnp.asarray(rng.standard_normal((p, d), dtype=np.float32))
            apart = timed(run, decode, repeat=args.repeat) + timed(run, prefill, repeat=args.repeat)
            together = timed(both, decode, prefill, repeat=args.repeat)
            one = timed(joined, decode, prefill, repeat=args.repeat)
            print(f"| {p} | {apart * 1e3:.1f} | {together * 1e3:.1f} | {one * 1e3:.1f} |")
            report["riding"][p] = {"apart_ms": apart * 1e3, "together_ms": together * 1e3,
                                   "joined_ms": one * 1e3}  # fmt: skip
    print(f"\nload average after: {os.getloadavg()}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
