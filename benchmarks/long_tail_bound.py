"""What bounds the rollout engine against the static sampler on the long-tail mix: measured
decode-step costs, the engine's schedule replayed with them, and what other schedules would reach.

    python benchmarks/long_tail_bound.py [--shape 100m] [--dtype auto] [--slots 16]
        [--median 8] [--max-new 64] [--repeat 3] [--costs 4 8 16 32 64]

The model, prompts and limits are ``sampler_bench.py``'s long-tail case (its functions, same
seed). Measured in one process, each time the median of ``--repeat`` calls after a warm-up call:

- the static sampler's call (the baseline: every row decodes to the longest limit);
- the engine's call as the benchmark runs it (``--slots`` slots, refilled every step, requests
  admitted in request order) and the decode steps it ran;
- the engine's prefill: a call where every limit is 1 (the prefill plus one one-token step per
  wave of ``--slots`` requests), less those steps;
- one decode step at each slot count S of ``--costs``: (a call where every request generates
  ``--cost-tokens`` tokens - a call where each generates 1) / (the decode steps between them),
  so the step's whole cost (model, head, sampling, attention, refills) is in it.

The engine's schedule is then replayed in Python (:func:`replay`) with these step costs: first
as it runs (the replay's prediction of the measured call checks the model), then as schedules
the engine does not have would run it:

- **compacted**: each step runs only its live slots, padded to the smallest measured slot count
  that holds them (a decode batch that shrinks as requests stop, as vLLM's does);
- **all admitted, compacted**: one slot per request (no request waits for a slot), compacted;
- **... with free prefill**: the same with the prefill costing nothing (its limit if prefill
  chunks hid entirely inside decode steps).

Each line prints the predicted seconds per call and the ratio against the measured static call.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

__all__ = ["replay"]


def replay(
    limits: Sequence[int],
    slots: int,
    step_cost: Callable[[int], float],
    *,
    compact: Sequence[int] = (),
) -> tuple[int, float]:
    """``(decode steps, seconds)`` of the engine's schedule for requests of these token limits:
    ``slots`` decode slots; at the start of every step each empty slot takes the next waiting
    request in request order; a request of limit n holds its slot for n steps. A step costs
    ``step_cost(S)``: S = ``slots``, or with ``compact`` (sorted slot counts) the smallest of
    them that holds the step's live slots (``slots`` when none does)."""
    waiting = [int(n) for n in limits]
    if any(n < 1 for n in waiting) or slots < 1:
        raise ValueError(f"replay: limits must be >= 1 and slots >= 1, got {limits}, {slots}")
    waiting.reverse()  # pop() takes the next request in order
    left: list[int] = []  # tokens still to generate, one entry per live slot
    steps, seconds = 0, 0.0
    while waiting or left:
        while waiting and len(left) < slots:
            left.append(waiting.pop())
        size = next((s for s in sorted(compact) if s >= len(left)), slots)
        seconds += step_cost(size)
        steps += 1
        left = [n - 1 for n in left if n > 1]
    return steps, seconds


def _median_call(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm-up: compiles
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    import flax.nnx as nnx
    import jax
    from machine import machine
    from sampler_bench import EOS, GREEDY, PAD, SHAPES, long_tail_limits
    from static_sampler import StaticSampler

    from jaxrl.generate.sampler import Sampler
    from jaxrl.models.model_config import ModelConfig
    from jaxrl.models.transformer import Transformer
    from jaxrl.train.precision import auto_compute_dtype, auto_matmul_dtype

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="100m")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--median", type=float, default=8)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--costs", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    ap.add_argument("--cost-tokens", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[16, 48], help="min max")
    ap.add_argument("--dtype", choices=("float32", "auto"), default="auto")
    args = ap.parse_args()
    if args.slots not in args.costs:
        ap.error(f"--costs must include --slots ({args.slots}) to replay the engine as it runs")

    # the model, prompts and limits of sampler_bench.py's long-tail case (same draws, in order)
    config = ModelConfig.tiny(**SHAPES[args.shape])
    model = Transformer(config, rngs=nnx.Rngs(0))
    if args.dtype == "auto":
        config = dataclasses.replace(
            config, dtype=auto_compute_dtype("auto"), matmul_dtype=auto_matmul_dtype(None, "auto")
        )
    model.embedding[...] = model.embedding[...].at[EOS].set(0.0)
    rng = np.random.default_rng(0)
    lengths = rng.integers(args.prompt_len[0], args.prompt_len[1] + 1, size=args.batch)
    prompts = [rng.integers(2, config.vocab_size, size=n).astype(np.int32) for n in lengths]
    tail = long_tail_limits(rng, args.batch, args.median, args.sigma, args.max_new)
    key = jax.random.key(0)
    print(json.dumps(machine(("jax", "jaxlib"))))
    print(f"model {args.shape}, compute {config.dtype} (matmul operands "
          f"{config.matmul_dtype or config.dtype}); B={args.batch}, useful tokens {tail.sum()} "
          f"(limits median {int(np.median(tail))}, max {tail.max()})")  # fmt: skip

    static = StaticSampler(config, max_new_tokens=args.max_new, eos_id=EOS, pad_id=PAD)
    static.load_params(model)
    t_static = _median_call(lambda: static.generate(prompts, key, GREEDY), args.repeat)

    def engine(slots: int) -> Callable[[np.ndarray], object]:
        sampler = Sampler(config, max_new_tokens=args.max_new, eos_id=EOS, pad_id=PAD,
                          max_slots=slots)  # fmt: skip
        sampler.load_params(model)
        return lambda limits: sampler.generate(prompts, key, GREEDY, max_tokens=limits)

    b = args.batch
    ones, equal = np.ones(b, np.int32), np.full(b, args.cost_tokens, np.int32)
    cost, prefill = {}, None
    for s in sorted(set(args.costs)):
        call = engine(s)
        steps_1, steps_n = call(ones).num_steps, call(equal).num_steps
        t_1 = _median_call(lambda c=call: c(ones), args.repeat)
        t_n = _median_call(lambda c=call: c(equal), args.repeat)
        cost[s] = (t_n - t_1) / (steps_n - steps_1)
        if s == args.slots:
            prefill = t_1 - steps_1 * cost[s]
            shipped = call(tail).num_steps
            t_engine = _median_call(lambda c=call: c(tail), args.repeat)
        print(f"S={s}: {cost[s] * 1e3:.1f} ms per decode step", flush=True)
    sizes = sorted(cost)

    print(f"\nstatic sampler, measured: {t_static:.2f} s per call")
    print(f"engine ({args.slots} slots), measured: {t_engine:.2f} s per call, {shipped} decode "
          f"steps, {t_static / t_engine:.2f}x static; its prefill {prefill:.2f} s")  # fmt: skip
    print("\n| schedule (replayed with the measured step costs) | decode steps | s per call "
          "| vs static |\n|---|---|---|---|")  # fmt: skip
    rows = {
        f"as the engine runs: {args.slots} slots, refilled in request order": (args.slots, 0, 1),
        f"{args.slots} slots, compacted": (args.slots, 1, 1),
        "all admitted (one slot per request), not compacted": (b, 0, 1),
        "all admitted, compacted": (b, 1, 1),
        "all admitted, compacted, free prefill": (b, 1, 0),
    }
    report = {"static_s": t_static, "engine_s": t_engine, "engine_steps": shipped,
              "prefill_s": prefill, "step_cost_s": cost, "replay": {}}  # fmt: skip
    for name, (slots, compacted, with_prefill) in rows.items():
        if slots not in cost:
            print(f"| {name} | - | not replayed: --costs has no {slots} | - |")
            continue
        compact = [s for s in sizes if s <= slots] if compacted else ()
        steps, decode_s = replay(tail, slots, cost.__getitem__, compact=compact)
        total = decode_s + with_prefill * prefill
        report["replay"][name] = {"steps": steps, "s": total, "vs_static": t_static / total}
        print(f"| {name} | {steps} | {total:.2f} | {t_static / total:.2f}x |")
    print(f"\nload average after: {os.getloadavg()}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
