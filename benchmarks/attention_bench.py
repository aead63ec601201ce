"""Benchmark of attention implementations on CPU: dense ``xla`` vs blockwise ``flash``.

The tiny configs' attention shape (H=4 query heads, K=2 kv heads, Dh=32, fp32) on one packed
row of short documents (lengths 9..17, like the arithmetic SFT task), in three layouts:

- ``T=256 full``: 256 tokens of documents (sft_tiny's ``schedule.max_tokens``);
- ``T=4096 sparse``: 661 real tokens of documents, then padding to 4096;
- ``T=4096 one doc``: a single 4096-token document (the dense worst case for flash).

Each layout is timed forward only and forward + backward (gradients of q, k, v), jitted, best
of ``--repeat`` runs after a warm-up. ``visited`` is flash's number of visited (query block,
key block) pairs out of all pairs. Not a test: it asserts nothing and prints a markdown table
for benchmarks/README.md.

    python benchmarks/attention_bench.py [--repeat 5] [--block 128]
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.models.attention.dense import attention, positions_from_segments
from jaxrl.models.attention.flash import block_visibility, flash_attention

H, K, DH = 4, 2, 32


def packed_row(t: int, real: int | None, seed: int = 0) -> np.ndarray:
    """Segment ids [1, t]: documents of 9..17 tokens up to ``real`` tokens, then padding."""
    rng = np.random.default_rng(seed)
    seg, at, doc = np.zeros((1, t), np.int32), 0, 1
    real = t if real is None else real
    while at < real:
        n = min(int(rng.integers(9, 18)), real - at)
        seg[0, at : at + n], at, doc = doc, at + n, doc + 1
    return seg


def time_fn(fn, args, repeat: int) -> float:
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--block", type=int, default=128)
    args = parser.parse_args()
    layouts = [
        ("T=256 full", packed_row(256, None)),
        ("T=4096 sparse (661 real)", packed_row(4096, 661)),
        ("T=4096 one doc", np.ones((1, 4096), np.int32)),
    ]
    print(
        f"jax {jax.__version__} on {jax.default_backend()}, {platform.machine()}, "
        f"{os.cpu_count()} CPUs; H={H} K={K} Dh={DH} fp32, B=1, block={args.block}\n"
    )
    print("| layout | impl | fwd ms | fwd+bwd ms | flash/xla fwd | flash/xla fwd+bwd | visited |")
    print("|---|---|---|---|---|---|---|")
    results = {}
    for name, seg_np in layouts:
        t = seg_np.shape[1]
        rng = np.random.default_rng(1)
        q = jnp.asarray(rng.normal(size=(1, t, H, DH)), jnp.float32)
        k, v = (jnp.asarray(rng.normal(size=(1, t, K, DH)), jnp.float32) for _ in range(2))
        seg = jnp.asarray(seg_np)
        pos = positions_from_segments(seg)
        impls = {
            "xla": attention,
            "flash": lambda *a: flash_attention(*a, block_size=args.block),
        }
        times = {}
        for impl, fn in impls.items():

            def fwd(q, k, v, fn=fn, seg=seg, pos=pos):
                return fn(q, k, v, seg, seg, pos, pos)

            def loss(q, k, v, fwd=fwd):
                return jnp.sum(fwd(q, k, v) ** 2)

            grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
            times[impl] = (
                time_fn(jax.jit(fwd), (q, k, v), args.repeat),
                time_fn(grad, (q, k, v), args.repeat),
            )
        b = min(args.block, t)
        vis = block_visibility(seg, seg, pos, pos, block_q=b, block_kv=b)
        visited = f"{int(vis.sum())}/{vis.size}"
        results[name] = times
        xf, xfb = times["xla"]
        ff, ffb = times["flash"]
        print(f"| {name} | xla | {xf * 1e3:.2f} | {xfb * 1e3:.2f} | | | |")
        print(
            f"| {name} | flash | {ff * 1e3:.2f} | {ffb * 1e3:.2f} | {ff / xf:.3g} | "
            f"{ffb / xfb:.3g} | {visited} |"
        )
    sparse, short = results["T=4096 sparse (661 real)"], results["T=256 full"]
    print("\nT=4096 sparse / T=256 full, fwd+bwd time:")
    for impl in ("xla", "flash"):
        print(f"  {impl}: {sparse[impl][1] / short[impl][1]:.1f}x")


if __name__ == "__main__":
    main()
