"""One GRPO-shaped train micro-batch of SmolLM2-135M-Instruct on this machine: forward and
forward + backward of the token log-probs (fp32 head) over one packed row, in several model
layouts, to see where a real-checkpoint step's train time goes.

    python benchmarks/train_step_bench.py [KEY=VALUE ...]      # e.g. remat=none attention_impl=xla
    python benchmarks/train_step_bench.py layout=shared         # one row per 2 groups of G=4

The row is the shape of ``real_model.py grpo``'s steps: 8 documents of 173 tokens (139 prompt +
34 completion, the loss on the completion) packed into one row of T = 1536 (``T=...``), random
token ids. ``layout=shared`` lays the same 8 completions out as 2 prompts x G=4 with
shared-prompt packing (``parent_ids``, docs/attention.md): per group ``[p[:-1] | p[-1] c1 |
p[-1] c2 | ...]``, 2 x (138 + 4 x 35) = 556 tokens in a row of T = 640 by default.
``weights=random`` builds SmolLM2-135M's shape with random weights (the default when the
converted checkpoint, ``real_model.py convert``, is absent); timings do not depend on the
weights. Other KEY=VALUE pairs go to ``jaxrl.models.hf.from_pretrained`` (defaults: fp32, fp32
head, scanned layers, ``remat=block``, ``attention_impl=flash``: what the shipped config
resolves to on a CPU). Prints the best and the median of 3 timed calls of each jitted function
after a warm-up, and their median CPU time (all threads; steadier on a loaded machine). The
micro-batch carries the ``loss_mask``, so the head runs only at the loss positions. Results:
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

from jaxrl.models.hf import config_from_hf, from_pretrained
from jaxrl.models.transformer import Transformer
from jaxrl.train.forward import micro_batch_logprobs

MODEL_DIR = Path(__file__).parent / ".cache" / "smollm2-135m-instruct"  # real_model.py convert
DOCS, DOC_LEN, PROMPT_LEN = 8, 173, 139
GROUP = 4  # layout=shared: DOCS // GROUP prompts, GROUP completions each
SMOLLM2_135M = dict(  # config.json of HuggingFaceTB/SmolLM2-135M-Instruct (the shape)
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=49152, hidden_size=576,
    intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
    head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
    tie_word_embeddings=True, attention_bias=False,
)  # fmt: skip


def _unshared(t: int, rng: np.random.Generator, vocab: int):
    tokens, seg = np.zeros((1, t), np.int32), np.zeros((1, t), np.int32)
    mask = np.zeros((1, t), np.float32)
    for d in range(DOCS):
        s = d * DOC_LEN
        tokens[0, s : s + DOC_LEN] = rng.integers(0, vocab, DOC_LEN)
        seg[0, s : s + DOC_LEN] = d + 1
        mask[0, s + PROMPT_LEN : s + DOC_LEN] = 1
    return {"tokens": tokens, "targets": np.roll(tokens, -1, 1), "segment_ids": seg}, mask


def _shared(t: int, rng: np.random.Generator, vocab: int):
    """Shared-prompt rows: ``[p[:-1] | p[-1] c1 | ... | p[-1] cG]`` per group, completions'
    parent = the prompt's segment, positions continuing the prompt's."""
    fields = {n: np.zeros((1, t), np.int32) for n in ("tokens", "positions", "segment_ids")}
    fields["parent_ids"] = np.zeros((1, t), np.int32)
    mask, at, sid = np.zeros((1, t), np.float32), 0, 0
    completion = DOC_LEN - PROMPT_LEN
    for _ in range(DOCS // GROUP):
        prompt = rng.integers(0, vocab, PROMPT_LEN)
        sid += 1
        parent, n = sid, PROMPT_LEN - 1
        fields["tokens"][0, at : at + n] = prompt[:-1]
        fields["positions"][0, at : at + n] = np.arange(n)
        fields["segment_ids"][0, at : at + n] = parent
        at += n
        for _ in range(GROUP):
            sid, n = sid + 1, completion + 1
            fields["tokens"][0, at : at + n] = [prompt[-1], *rng.integers(0, vocab, completion)]
            fields["positions"][0, at : at + n] = np.arange(PROMPT_LEN - 1, DOC_LEN)
            fields["segment_ids"][0, at : at + n] = sid
            fields["parent_ids"][0, at : at + n] = parent
            mask[0, at : at + completion] = 1  # p[-1] predicts c[0], ... c[-2] predicts c[-1]
            at += n
    if at > t:
        raise SystemExit(f"layout=shared needs T >= {at}, got T={t}")
    return fields | {"targets": np.roll(fields["tokens"], -1, 1)}, mask


def main() -> None:
    kw = dict(param_dtype="float32", dtype="float32", fp32_lm_head=True, scan_layers=True,
              remat="block", attention_impl="flash")  # fmt: skip
    for arg in sys.argv[1:]:
        k, v = arg.split("=", 1)
        kw[k] = v
    layout = kw.pop("layout", "unshared")
    t = int(kw.pop("T", 640 if layout == "shared" else 1536))
    if "attention_block_size" in kw:
        kw["attention_block_size"] = int(kw["attention_block_size"])
    if kw.pop("weights", "checkpoint") == "random" or not MODEL_DIR.exists():
        model = Transformer(config_from_hf(SMOLLM2_135M, **kw), rngs=nnx.Rngs(0))
    else:
        model = from_pretrained(MODEL_DIR, **kw)
    build = _shared if layout == "shared" else _unshared
    mb, mask = build(t, np.random.default_rng(0), model.config.vocab_size)
    mb["loss_mask"] = mask  # the head runs only at the loss positions
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
