"""What drawing one token per decode slot costs: ``sample_tokens`` (Gumbel-max over the full
vocabulary with per-request threefry keys, the engine's draw) against alternatives, at the
engine's B = 64 slots and SmolLM2's V = 49,152 (``--batch``, ``--vocab``).

    python benchmarks/draw_bench.py

Rows: the engine's draw; ``jax.random.categorical``, which draws the same tokens (the engine
used it until ``gumbel_max``: XLA's CPU backend runs its argmax, fused with the noise, as scalar
code); the same with JAX's ``rbg`` / ``unsafe_rbg`` keys; an inverse-CDF draw
(one uniform per request, a cumulative sum and a count: another random stream, so not a drop-in
replacement); ``argmax`` + ``logsumexp`` (what a greedy step computes) as the floor. Median of
20 jitted calls after a warm-up. Results: benchmarks/README.md ("Engine vs vLLM-CPU").
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from machine import machine

from jaxrl.generate.sampling import sample_tokens, token_key


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args()
    b, v = args.batch, args.vocab
    print(machine(("jax", "jaxlib")))
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(b, v)).astype(np.float32))
    one, zero_k, off_p = jnp.float32(1.0), jnp.int32(0), jnp.float32(1.0)

    def keys(impl: str, t: jax.Array) -> jax.Array:
        key = jax.random.key(0, impl=impl)
        return jax.vmap(token_key, in_axes=(None, 0, None))(key, jnp.arange(b), t)

    def engine_draw(impl: str):
        return jax.jit(lambda z, t: sample_tokens(keys(impl, t), z, one, zero_k, off_p))

    @jax.jit
    def categorical(z, t):  # the engine's draw before issue 34: the same tokens
        k = keys("threefry2x32", t)
        return jax.vmap(jax.random.categorical)(k, z), jax.nn.logsumexp(z, -1)

    @jax.jit
    def inverse_cdf(z, t):
        u = jax.vmap(jax.random.uniform)(keys("threefry2x32", t))
        m = jnp.max(z, -1, keepdims=True)
        c = jnp.cumsum(jnp.exp(z - m), -1)
        tok = jnp.minimum(jnp.sum(c <= u[:, None] * c[:, -1:], -1), v - 1)
        return tok, jnp.take_along_axis(z, tok[:, None], -1)[:, 0] - jnp.log(c[:, -1]) - m[:, 0]

    @jax.jit
    def greedy(z, t):
        return jnp.argmax(z, -1), jax.nn.logsumexp(z, -1)

    rows = {
        "sample_tokens, threefry keys (the engine)": engine_draw("threefry2x32"),
        "jax.random.categorical + logsumexp (before: the same tokens)": categorical,
        "sample_tokens, rbg keys": engine_draw("rbg"),
        "sample_tokens, unsafe_rbg keys": engine_draw("unsafe_rbg"),
        "inverse CDF (another stream)": inverse_cdf,
        "argmax + logsumexp (floor)": greedy,
    }
    print(f"| draw, B={b}, V={v} | ms per step (median of {args.calls}) |\n|---|---|")
    for name, fn in rows.items():
        jax.block_until_ready(fn(logits, 0))
        times = []
        for i in range(args.calls):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(logits, i))
            times.append(time.perf_counter() - t0)
        print(f"| {name} | {1000 * float(np.median(times)):.1f} |", flush=True)


if __name__ == "__main__":
    main()
