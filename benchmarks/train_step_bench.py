"""One GRPO-shaped train micro-batch of SmolLM2-135M-Instruct on this machine: forward and
forward + backward of the token log-probs (fp32 head) over one packed row, in several model
layouts, to see where a real-checkpoint step's train time goes.

    python benchmarks/train_step_bench.py [KEY=VALUE ...]      # e.g. remat=none attention_impl=xla

The row is the shape of ``real_model.py grpo``'s steps: 8 documents of 173 tokens (139 prompt +
34 completion, the loss on the completion) packed into one row of T = 1536 (``T=...``), random
token ids. KEY=VALUE pairs go to ``jaxrl.models.hf.from_pretrained`` (defaults: fp32, fp32 head,
scanned layers, ``remat=block``, ``attention_impl=flash``: what the shipped config resolves to
on a CPU). Prints the best and the median of 3 timed calls of each jitted function after a
warm-up, and their median CPU time (all threads; steadier on a loaded machine). The loss is
on the completion tokens, so the head runs only there (``loss_mask``). Results:
docs/performance.md.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from jaxrl.models.hf import from_pretrained
from jaxrl.train.forward import micro_batch_logprobs

MODEL_DIR = Path(__file__).parent / ".cache" / "smollm2-135m-instruct"  # real_model.py convert
DOCS, DOC_LEN, PROMPT_LEN = 8, 173, 139


def main() -> None:
    kw = dict(param_dtype="float32", dtype="float32", fp32_lm_head=True, scan_layers=True,
              remat="block", attention_impl="flash")  # fmt: skip
    for arg in sys.argv[1:]:
        k, v = arg.split("=", 1)
        kw[k] = v
    t = int(kw.pop("T", 1536))
    model = from_pretrained(MODEL_DIR, **kw)
    rng = np.random.default_rng(0)
    tokens, seg = np.zeros((1, t), np.int32), np.zeros((1, t), np.int32)
    mask = np.zeros((1, t), np.float32)
    for d in range(DOCS):
        s = d * DOC_LEN
        tokens[0, s : s + DOC_LEN] = rng.integers(0, model.config.vocab_size, DOC_LEN)
        seg[0, s : s + DOC_LEN] = d + 1
        mask[0, s + PROMPT_LEN : s + DOC_LEN] = 1
    mb = {"tokens": tokens, "targets": np.roll(tokens, -1, 1), "segment_ids": seg,
          "loss_mask": mask}  # fmt: skip
    graphdef, params = nnx.split(model)

    def loss(p):
        logp, _ = micro_batch_logprobs(nnx.merge(graphdef, p), mb)
        return -(logp * mask).sum() / mask.sum()

    def bench(fn):
        jax.block_until_ready(fn(params))
        times, cpu = [], []
        for _ in range(3):
            t0, c0 = time.perf_counter(), time.process_time()
            jax.block_until_ready(fn(params))
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        # CPU seconds (all threads) are steadier than wall time on a loaded machine
        return (f"{min(times):.2f} s (median {float(np.median(times)):.2f}, "
                f"CPU {float(np.median(cpu)):.2f} s)")  # fmt: skip

    fwd, grad = jax.jit(loss), jax.jit(jax.value_and_grad(loss))
    print(f"{sys.argv[1:] or 'defaults'} T={t}: forward {bench(fwd)}, forward + backward "
          f"{bench(grad)}; load {os.getloadavg()[0]:.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
