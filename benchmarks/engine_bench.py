"""Step time of the while_loop engine vs a static lax.scan vs one big batch (same data).

    python benchmarks/engine_bench.py [--layers 4 --width 256 --rows 8 --row-len 256 --iters 20]

All three compute the same gradient of the same token-normalised cross-entropy over the same
packed rows and apply the same AdamW update; they differ only in how micro-batches are
iterated. Prints median step times and the ratios, measured side by side in one process.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

import flax.nnx as nnx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from jaxrl.config import SFTConfig  # noqa: E402
from jaxrl.data.batching.packing import pack_sequences  # noqa: E402
from jaxrl.models.model_config import ModelConfig  # noqa: E402
from jaxrl.models.transformer import Transformer  # noqa: E402
from jaxrl.train.objectives import on_params, sft_objective  # noqa: E402
from jaxrl.train.state import TrainState  # noqa: E402
from jaxrl.train.step import TrainStep, make_mesh  # noqa: E402

FIELDS = ("tokens", "targets", "loss_mask", "segment_ids", "positions", "doc_sample_index")


def _time_interleaved(fns: dict, iters: int) -> dict[str, float]:
    """Median seconds per call of each function, measured round-robin so load drift on a
    shared machine hits every variant alike."""
    for fn in fns.values():
        jax.block_until_ready(fn())  # compile + warm up
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--rows", type=int, default=8, help="micro-batches (rows) per step")
    ap.add_argument("--row-len", type=int, default=256)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()

    rng = np.random.default_rng(0)
    lengths = rng.integers(16, args.row_len // 2, size=4 * args.rows)
    seqs = [rng.integers(0, args.vocab, size=n) for n in lengths]
    real = pack_sequences(seqs, row_len=args.row_len).num_micro_batches
    packed = pack_sequences(seqs, row_len=args.row_len, num_slots=real, num_segments=64)
    bucket = pack_sequences(seqs, row_len=args.row_len, num_slots=2 * real, num_segments=64)
    k = real
    batch_np = {f: getattr(packed, f) for f in FIELDS}
    bucket_np = {f: getattr(bucket, f) for f in FIELDS}

    cfg = ModelConfig.tiny(
        args.vocab,
        hidden_size=args.width,
        num_hidden_layers=args.layers,
        intermediate_size=3 * args.width,
    )
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))

    loss = on_params(sft_objective(SFTConfig(loss_normalization="token")), graphdef)

    tx = optax.adamw(1e-3)
    mesh = make_mesh(1)
    fns = {}
    for label, arrays in (("", batch_np), (" (2x bucket)", bucket_np)):
        for name in ("while", "scan"):
            step = TrainStep(loss, tx, mesh, learning_rate=lambda s: 1e-3, loop=name, donate=False)
            state = step.place(TrainState.create(params, tx, 0))
            batch = step.shard_batch(arrays)
            stop = real if name == "while" else None  # scan walks every slot of the bucket

            def run(step=step, state=state, batch=batch, stop=stop):
                return step(state, batch, 0, stop)[0]

            fns[name + label] = run

    big = {f: jnp.asarray(v[0]) for f, v in batch_np.items()}  # all K rows in one forward

    @jax.jit
    def big_step(state):
        def objective(p):
            t = loss(p, big)
            return t.numerator / jnp.maximum(t.denominator, 1.0)

        grads = jax.grad(objective)(state.params)
        p32 = jax.tree.map(lambda p: p.astype(jnp.float32), state.params)
        updates, opt = tx.update(grads, state.opt_state, p32)
        return state.replace(params=optax.apply_updates(p32, updates), opt_state=opt)

    state = TrainState.create(params, tx, 0)
    fns["one big batch"] = lambda: big_step(state)
    results = _time_interleaved(fns, args.iters)

    print(
        f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), "
        f"model D={args.width} L={args.layers} V={args.vocab}, {k} rows x {args.row_len} tokens"
    )
    for name, t in results.items():
        print(f"{name:>20}: {t * 1e3:8.2f} ms/step")
    print(f"while / scan (same micro-batches)  = {results['while'] / results['scan']:.3f}")
    b = " (2x bucket)"
    print(f"while / scan (2x padded K bucket)  = {results['while' + b] / results['scan' + b]:.3f}")
    print(f"while / one big batch              = {results['while'] / results['one big batch']:.3f}")


if __name__ == "__main__":
    main()
