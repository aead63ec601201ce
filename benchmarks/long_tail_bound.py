"""What bounds the rollout engine against the static sampler on the long-tail mix: measured
decode-step costs, the engine's schedule replayed with them, and what other schedules would reach.

    python benchmarks/long_tail_bound.py [--shape 100m] [--dtype auto] [--slots 16]
        [--median 8] [--max-new 64] [--repeat 3] [--costs 4 8 16 32 64]

The model, prompts and limits are ``sampler_bench.py``'s long-tail case (its functions, same
seed). Measured in one process, each time the median of ``--repeat`` calls after a warm-up call:

- the static sampler's call (the baseline: every row decodes to the longest limit);
- one decode step at each slot count S of ``--costs``, every step over all S slots
  (``compact_slots=False``): (a call where every request generates ``--cost-tokens`` tokens -
  a call where each generates 1) / (the decode steps between them), so the step's whole cost
  (model, head, sampling, attention, refills) is in it;
- the engine's prefill: the ``--slots`` call with every limit 1, less its one-token steps.

Then each schedule of the table is replayed in Python (:func:`replay`: slots refilled in
request order at every step) with these step costs, and the engine's own call is measured
where it has that schedule, with its decode steps checked against the replay's:

- ``--slots`` slots, every step over all of them (``compact_slots=False``), and compacted as
  the engine does (``compact_slots=True``: steps at a quarter and a half of the slots,
  ``sampler.compact_sizes``);
- the same with one slot per request (every request admitted at once, as vLLM admits a batch
  that fits);
- replayed only: compacted to every measured size (a batch that shrinks step by step), and
  that with the prefill free (its limit if prefill chunks hid entirely inside decode steps).

Each row prints the replayed and the measured seconds per call and the ratio against the
measured static call (of the measured call where there is one).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
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


def main() -> None:
    import jax
    from harness import median_call
    from machine import machine
    from sampler_bench import (
        EOS,
        GREEDY,
        PAD,
        bench_model,
        bench_prompts,
        long_tail_arguments,
        long_tail_limits,
    )
    from static_sampler import StaticSampler

    from jaxrl.generate.sampler import Sampler, compact_sizes

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    long_tail_arguments(ap, shape="100m", median=8, max_new=64, dtype="auto")
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--costs", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    ap.add_argument("--cost-tokens", type=int, default=16)
    args = ap.parse_args()
    if args.slots not in args.costs:
        ap.error(f"--costs must include --slots ({args.slots}) to replay the engine as it runs")

    # the model, prompts and limits of sampler_bench.py's long-tail case (same draws, in order)
    config, model = bench_model(args.shape, args.dtype)
    rng = np.random.default_rng(0)
    prompts = bench_prompts(rng, config.vocab_size, args.batch, args.prompt_len)
    tail = long_tail_limits(rng, args.batch, args.median, args.sigma, args.max_new)
    key = jax.random.key(0)
    print(json.dumps(machine(("jax", "jaxlib"))))
    print(f"model {args.shape}, compute {config.dtype} (matmul operands "
          f"{config.matmul_dtype or config.dtype}); B={args.batch}, useful tokens {tail.sum()} "
          f"(limits median {int(np.median(tail))}, max {tail.max()})")  # fmt: skip

    static = StaticSampler(config, max_new_tokens=args.max_new, eos_id=EOS, pad_id=PAD)
    static.load_params(model)
    t_static = median_call(lambda: static.generate(prompts, key, GREEDY), args.repeat)

    def engine(slots: int, compact: bool) -> Callable[[np.ndarray], object]:
        sampler = Sampler(config, max_new_tokens=args.max_new, eos_id=EOS, pad_id=PAD,
                          max_slots=slots, compact_slots=compact)  # fmt: skip
        sampler.load_params(model)
        return lambda limits: sampler.generate(prompts, key, GREEDY, max_tokens=limits)

    b = args.batch
    ones, equal = np.ones(b, np.int32), np.full(b, args.cost_tokens, np.int32)
    cost, prefill = {}, 0.0
    for s in sorted(set(args.costs)):  # every step over all S slots: compaction off
        call = engine(s, compact=False)
        steps_1, steps_n = call(ones).num_steps, call(equal).num_steps
        t_1 = median_call(lambda c=call: c(ones), args.repeat)
        t_n = median_call(lambda c=call: c(equal), args.repeat)
        cost[s] = (t_n - t_1) / (steps_n - steps_1)
        if s == args.slots:
            prefill = t_1 - steps_1 * cost[s]
        print(f"S={s}: {cost[s] * 1e3:.1f} ms per decode step", flush=True)
    sizes = sorted(cost)
    print(f"prefill (from the {args.slots}-slot calls): {prefill:.2f} s")
    print(f"static sampler, measured: {t_static:.2f} s per call")

    # (slots, compaction sizes or None = every measured size, measured with compact_slots?,
    # prefill counted?)
    rows = {
        f"{args.slots} slots, every step over all of them": (args.slots, (), False, 1),
        f"{args.slots} slots, compacted as the engine does": (
            args.slots, compact_sizes(args.slots), True, 1),
        f"{args.slots} slots, compacted to every measured size": (args.slots, None, None, 1),
        "all admitted (one slot each), every step over all": (b, (), False, 1),
        "all admitted, compacted as the engine does": (b, compact_sizes(b), True, 1),
        "all admitted, compacted to every measured size": (b, None, None, 1),
        "all admitted, compacted to every size, free prefill": (b, None, None, 0),
    }  # fmt: skip
    print("\n| schedule | decode steps | s per call, replayed | measured | vs static "
          "(measured, else replayed) |\n|---|---|---|---|---|")  # fmt: skip
    report = {"static_s": t_static, "prefill_s": prefill, "step_cost_s": cost, "rows": {}}
    for name, (slots, compact, measure, with_prefill) in rows.items():
        compact = [n for n in sizes if n < slots] if compact is None else compact
        missing = [n for n in (slots, *compact) if n not in cost]
        if missing:
            print(f"| {name} | - | not replayed: --costs has no {missing} | - | - |")
            continue
        steps, decode_s = replay(tail, slots, cost.__getitem__, compact=compact)
        replayed = decode_s + with_prefill * prefill
        measured = None
        if measure is not None:
            call = engine(slots, compact=measure)
            ran = call(tail).num_steps
            assert ran == steps, f"{name}: the engine ran {ran} steps, the replay {steps}"
            measured = median_call(lambda c=call: c(tail), args.repeat)
        seconds = replayed if measured is None else measured
        report["rows"][name] = {
            "steps": steps, "compact": list(compact), "replayed_s": replayed,
            "measured_s": measured, "vs_static": t_static / seconds,
        }  # fmt: skip
        shown = "-" if measured is None else f"{measured:.2f}"
        print(f"| {name} (sizes {list(compact) or '-'}) | {steps} | {replayed:.2f} | {shown} | "
              f"{t_static / seconds:.2f}x |", flush=True)  # fmt: skip
    print(f"\nload average after: {os.getloadavg()}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
