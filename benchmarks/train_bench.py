"""Train-step time, tokens/s and model FLOP/s of jaxrl's SFT step, optionally side by side with
transformers (torch) on the same packed micro-batches.

    python benchmarks/train_bench.py --max-tokens 256 1024 4096 --attention flash xla --steps 12
    python benchmarks/train_bench.py --torch --steps 12
    python benchmarks/train_bench.py --shape 100m --max-tokens 1024 --docs 8 --steps 4 --torch

jaxrl runs its own path: ``Session`` (model, compiled ``TrainStep``, AdamW, clipping) built from
``--config`` plus the overrides below, each step planned by ``Session.plan`` (schedule, packing,
row buckets) and run by ``Session.train_on``. Every variant (``--max-tokens`` x ``--attention``,
and with ``--torch`` a transformers model per ``--max-tokens``) trains on the same documents per
step, and the variants take their steps round-robin, so load drift hits all alike.

Documents: ``tiny`` uses the config's task (sft_tiny: 2-digit additions, ~10 tokens each,
``sft.per_device_train_batch_size`` per step, one rank); ``100m`` uses random token ids with
lengths uniform in ``[--min-len, --max-len]``, ``--docs`` per step, loss on every token after
the first.

torch side: ``LlamaForCausalLM`` loaded from jaxrl's initial weights (``save_pretrained``), sdpa
attention, one unpadded row per jaxrl micro-batch with ``position_ids`` restarting per document
and no attention mask (transformers then builds a block-diagonal causal mask from the
positions), gradient accumulation over the rows, clipping, AdamW with jaxrl's decay mask, betas,
eps and learning-rate schedule. Step 1's loss must agree with jaxrl's (same weights and data).

Model FLOPs per step = 6 N tokens + 6 L H Dh sum(len^2) (causal attention, forward + backward),
N the matmul parameters (the layers and the LM head), tokens the real (unpadded) ones: padding
is not counted as work. ``fill`` = real tokens / (rows x T) computed (torch rows are unpadded).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
# idle OpenMP threads sleep instead of spinning: spinning torch threads starve XLA's (and the
# other way round) when both share the cores; without it torch steps here ran up to 25x slower
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxrl.config import load_run_config  # noqa: E402
from jaxrl.data.documents import sft_documents  # noqa: E402
from jaxrl.data.feed import DocumentFeed  # noqa: E402
from jaxrl.data.tokenizer import char_tokenizer  # noqa: E402
from jaxrl.models.hf import save_pretrained  # noqa: E402
from jaxrl.train.build import build_task  # noqa: E402
from jaxrl.train.objectives import sft_objective  # noqa: E402
from jaxrl.train.optimizer import learning_rate_schedule  # noqa: E402
from jaxrl.trainers.session import Session  # noqa: E402

SHAPES = {
    "tiny": [],  # the config's own model.init (sft_tiny: D=128, 2 layers, H=4, K=2, F=384)
    "100m": [
        "model.init.hidden_size=768",
        "model.init.num_hidden_layers=12",
        "model.init.num_attention_heads=12",
        "model.init.num_key_value_heads=4",
        "model.init.intermediate_size=2048",
        "model.init.vocab_size=32000",
    ],
}


def documents(cfg: Any, args: argparse.Namespace) -> tuple[list, list, int]:
    """``(sequences, loss_masks, vocab_size)`` to train on."""
    if args.shape == "tiny":
        task = build_task(cfg)
        tok = char_tokenizer(task.alphabet)
        docs = sft_documents(
            task.dataset("sft", cfg.task.train_size),
            tok,
            max_length=cfg.sft.max_length,
            completion_only_loss=cfg.sft.completion_only_loss,
        )
        return docs.sequences, docs.masks, tok.vocab_size
    rng = np.random.default_rng(0)
    vocab = cfg.model.init["vocab_size"]
    lengths = rng.integers(args.min_len, args.max_len + 1, size=args.docs * (args.steps + 1))
    seqs = [rng.integers(0, vocab, size=n).astype(np.int32) for n in lengths]
    masks = [np.concatenate([[0.0], np.ones(n - 1)]).astype(np.float32) for n in lengths]
    return seqs, masks, vocab


def matmul_params(mc: Any) -> int:
    """N: parameters that take part in a matmul per token (layers + LM head, not the lookup)."""
    d, f, dh = (
        mc.hidden_size,
        mc.intermediate_size,
        mc.head_dim or mc.hidden_size // (mc.num_attention_heads),
    )
    attn = 2 * d * mc.num_attention_heads * dh + 2 * d * mc.num_key_value_heads * dh
    return mc.num_hidden_layers * (attn + 3 * d * f) + mc.vocab_size * d


def step_flops(mc: Any, lengths: list[int]) -> float:
    dh = mc.head_dim or mc.hidden_size // mc.num_attention_heads
    attn = 6 * mc.num_hidden_layers * mc.num_attention_heads * dh * sum(n * n for n in lengths)
    return 6.0 * matmul_params(mc) * sum(lengths) + attn


class JaxrlVariant:
    """jaxrl's SFT step on one ``(max_tokens, attention_impl)``."""

    def __init__(self, args, overrides, vocab, seqs, masks, out):
        self.cfg = load_run_config(args.config, [*overrides, f"output_dir={out}"])
        objective = sft_objective(self.cfg.sft, chunk_size=self.cfg.model.logprob_chunk)
        self.session = Session(self.cfg, vocab, objective)
        self.seqs, self.masks = seqs, masks
        self.lengths = np.asarray([len(s) for s in seqs], np.int64)

    def plan(self, ids):
        return self.session.plan(
            ids, lengths=self.lengths, sequences=self.seqs, loss_masks=self.masks
        )

    def step(self, ids) -> dict[str, Any]:
        row = self.session.train_on(self.plan(ids))  # metrics come back to the host: synced
        return {"loss": row["loss"], "compiles": row["compiles"], "T": row["row_len"],
                "rows": row["num_micro_batches"]}  # fmt: skip


class TorchVariant:
    """The same step in transformers: same weights, micro-batches, loss, clipping and AdamW."""

    def __init__(self, jaxrl: JaxrlVariant, hf_dir: Path):
        import torch
        import transformers

        self.torch = torch
        self.jaxrl = jaxrl
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            hf_dir, attn_implementation="sdpa", dtype=torch.float32
        ).train()
        o = jaxrl.cfg.optimizer
        params = [p for p in self.model.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": o.weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ]
        self.opt = torch.optim.AdamW(groups, lr=0.0, betas=(o.b1, o.b2), eps=o.eps)
        self.lr = learning_rate_schedule(o, jaxrl.cfg.max_steps)
        self.max_grad_norm = o.max_grad_norm
        self.count = 0

    def rows(self, micro_batches):
        torch, seqs, masks = self.torch, self.jaxrl.seqs, self.jaxrl.masks
        out = []
        for docs in micro_batches[0]:  # one data-parallel rank
            tokens = np.concatenate([seqs[d] for d in docs])
            positions = np.concatenate([np.arange(len(seqs[d])) for d in docs])
            mask = np.concatenate([masks[d] for d in docs])  # 0 on every document's first token
            out.append(
                tuple(torch.as_tensor(x[None]) for x in (tokens.astype(np.int64), positions, mask))
            )
        return out

    def step(self, micro_batches) -> dict[str, Any]:
        torch = self.torch
        rows = self.rows(micro_batches)
        denominator = sum(float(m[0, 1:].sum()) for _, _, m in rows)
        self.opt.zero_grad(set_to_none=True)
        total = 0.0
        for tokens, positions, mask in rows:
            # use_cache=False: with a cache, transformers ignores the packing in position_ids
            out = self.model(input_ids=tokens, position_ids=positions, use_cache=False)
            logits = out.logits[0, :-1]
            logp = torch.log_softmax(logits.float(), dim=-1)
            nll = -logp.gather(-1, tokens[0, 1:, None])[:, 0]
            loss = (nll * mask[0, 1:]).sum() / denominator
            loss.backward()
            total += loss.item()
        if self.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        for group in self.opt.param_groups:
            group["lr"] = float(self.lr(self.count))
        self.opt.step()
        self.count += 1
        lengths = [t.shape[1] for t, _, _ in rows]
        return {"loss": total, "rows": len(rows), "T": max(lengths), "slots": sum(lengths)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/sft_tiny.yaml")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--max-tokens", type=int, nargs="+", default=[256])
    ap.add_argument("--attention", nargs="+", default=["flash"], help="model.attention_impl")
    ap.add_argument("--steps", type=int, default=12, help="optimizer steps per variant")
    ap.add_argument(
        "--batch-size",
        type=int,
        default=0,
        help="sft.per_device_train_batch_size (tiny, one rank); 0: config",
    )
    ap.add_argument("--docs", type=int, default=8, help="documents per step (100m)")
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--torch", action="store_true", help="also train the transformers model")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--peak-flops", type=float, default=0.0, help="for MFU; 0: not reported")
    ap.add_argument("--set", action="append", default=[], help="more config overrides")
    args = ap.parse_args()

    base = ["mesh.data=1", f"max_steps={args.steps}", "logging.progress=false", *SHAPES[args.shape]]
    if args.batch_size:
        base.append(f"sft.per_device_train_batch_size={args.batch_size}")
    if args.shape == "100m":
        base.append(f"sft.per_device_train_batch_size={args.docs}")
    base += args.set
    cfg = load_run_config(args.config, base)
    seqs, masks, vocab = documents(cfg, args)
    feed = DocumentFeed(len(seqs), seed=cfg.seed)
    step_ids = [feed.take(cfg.sft.documents_per_step) for _ in range(args.steps)]

    tmp = Path(tempfile.mkdtemp(prefix="train_bench_"))
    variants: dict[str, Any] = {}
    for max_tokens in args.max_tokens:
        for impl in args.attention:
            over = [*base, f"schedule.max_tokens={max_tokens}", f"model.attention_impl={impl}"]
            name = f"jaxrl {impl} max_tokens={max_tokens}"
            variants[name] = JaxrlVariant(args, over, vocab, seqs, masks, tmp / name)
        if args.torch:
            import torch

            torch.set_num_threads(args.threads)
            ref = variants[f"jaxrl {args.attention[0]} max_tokens={max_tokens}"]
            hf_dir = tmp / f"hf{max_tokens}"
            save_pretrained(ref.session.model, hf_dir)
            variants[f"torch sdpa max_tokens={max_tokens}"] = TorchVariant(ref, hf_dir)
    mc = next(v for v in variants.values() if isinstance(v, JaxrlVariant)).session.model_config

    times: dict[str, list[float]] = {n: [] for n in variants}
    info: dict[str, list[dict]] = {n: [] for n in variants}
    for ids in step_ids:  # round-robin: every variant takes step s before any takes s + 1
        for name, v in variants.items():
            arg = ids if isinstance(v, JaxrlVariant) else v.jaxrl.plan(ids).micro_batches
            t0 = time.perf_counter()
            row = v.step(arg)
            times[name].append(time.perf_counter() - t0)
            info[name].append(row)

    lengths = [[len(seqs[i]) for i in ids] for ids in step_ids]
    print(
        f"jax {jax.__version__} ({jax.default_backend()}, {len(jax.devices())} device), "
        f"load average {os.getloadavg()[0]:.2f} at the end; model {args.shape}: "
        f"D={mc.hidden_size} L={mc.num_hidden_layers} H={mc.num_attention_heads} "
        f"K={mc.num_key_value_heads} F={mc.intermediate_size} V={mc.vocab_size} "
        f"tied={mc.tie_word_embeddings}, N(matmul)={matmul_params(mc) / 1e6:.2f}M; "
        f"{statistics.mean(map(sum, lengths)):.0f} real tokens / step "
        f"({len(step_ids[0])} documents)"
    )
    if args.torch:
        import torch

        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    header = (
        "| variant | rows x T | fill | timed steps | s/step median (min-max) | tokens/s | GFLOP/s |"
    )
    print(header + (" MFU |" if args.peak_flops else "") + " loss step 1 | loss last |")
    medians = {}
    for name in variants:
        rows = info[name]
        # steady state: drop step 1 (warm-up) and any step that compiled a new program
        keep = [
            i for i in range(1, len(rows))
            if rows[i].get("compiles", 0) == rows[i - 1].get("compiles", 0)
        ]  # fmt: skip
        ts = [times[name][i] for i in keep]
        if not ts:
            print(f"| {name} | no steady-state step |")
            continue
        med = medians[name] = statistics.median(ts)
        toks = statistics.mean(sum(lengths[i]) for i in keep)
        flops = statistics.mean(step_flops(mc, lengths[i]) for i in keep)
        shapes = sorted({(r["rows"], r["T"]) for r in rows})
        slots = statistics.mean(rows[i].get("slots", rows[i]["rows"] * rows[i]["T"]) for i in keep)
        cells = [
            name,
            ", ".join(f"{k}x{t}" for k, t in shapes),
            f"{toks / slots:.0%}",
            str(len(ts)),
            f"{med:.4f} ({min(ts):.4f}-{max(ts):.4f})",
            f"{toks / med:,.0f}",
            f"{flops / med / 1e9:.2f}",
        ]
        if args.peak_flops:
            cells.append(f"{flops / med / args.peak_flops:.1%}")
        cells += [f"{rows[0]['loss']:.5f}", f"{rows[-1]['loss']:.5f}"]
        extra = f" compiles={rows[-1]['compiles']}" if "compiles" in rows[-1] else ""
        print("| " + " | ".join(cells) + " |" + extra)
    small, large = min(args.max_tokens), max(args.max_tokens)
    for impl in args.attention:
        lo, hi = (f"jaxrl {impl} max_tokens={t}" for t in (small, large))
        if lo != hi and lo in medians and hi in medians:
            print(f"{impl}: max_tokens {large} / {small} = {medians[hi] / medians[lo]:.2f}x")
    for t in args.max_tokens:
        j, p = f"jaxrl {args.attention[0]} max_tokens={t}", f"torch sdpa max_tokens={t}"
        if j in medians and p in medians:
            print(f"max_tokens={t}: jaxrl/torch tokens/s = {medians[p] / medians[j]:.2f}")


if __name__ == "__main__":
    main()
