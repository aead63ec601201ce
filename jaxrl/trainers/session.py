"""What every trainer shares: model, mesh, compiled step, state, checkpoints, metrics, progress.

Orchestration only; the numerics live in losses/ and train/.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import flax.nnx as nnx
import jax
import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from jaxrl.config import RunConfig, to_dict
from jaxrl.data.packing import PackedBatch
from jaxrl.data.tasks import ArithmeticTask
from jaxrl.data.tokenizer import TextTokenizer
from jaxrl.losses.normalize import LossTerms
from jaxrl.models.hf import from_pretrained, save_pretrained
from jaxrl.models.transformer import ModelConfig, Transformer
from jaxrl.train.accumulate import LossFn
from jaxrl.train.checkpoint import Checkpointer
from jaxrl.train.metrics import MetricsWriter, to_python
from jaxrl.train.optimizer import learning_rate_schedule, make_optimizer
from jaxrl.train.state import TrainState
from jaxrl.train.step import TrainStep, make_mesh

DEVICE_FIELDS = ("tokens", "targets", "loss_mask", "segment_ids", "positions", "doc_sample_index")


def build_model(cfg: RunConfig, vocab_size: int) -> Transformer:
    """A local HF checkpoint (``model.path``) or a fresh ``ModelConfig.tiny`` model."""
    m = cfg.model
    if m.path is not None:
        return from_pretrained(
            m.path, param_dtype=m.param_dtype, dtype=m.dtype, fp32_lm_head=m.fp32_lm_head
        )
    init = dict(m.init)
    init.update(
        param_dtype=m.param_dtype, dtype=m.dtype or m.param_dtype, fp32_lm_head=m.fp32_lm_head
    )
    config = ModelConfig.tiny(vocab_size, **init)
    return Transformer(config, rngs=nnx.Rngs(params=cfg.seed))


def build_task(cfg: RunConfig) -> ArithmeticTask:
    """The built-in task the ``task`` section describes, seeded by the run."""
    t = cfg.task
    return ArithmeticTask(
        min_digits=t.min_digits,
        max_digits=t.max_digits,
        ops=t.ops,
        reverse_answer=t.reverse_answer,
        pad_operands=t.pad_operands,
        seed=cfg.seed,
    )


def device_arrays(packed: PackedBatch, extra: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    """The ``[R, K, ...]`` arrays the train step reads from a packed batch."""
    arrays = {name: getattr(packed, name) for name in DEVICE_FIELDS}
    for name in extra:
        arrays[name] = packed.token_fields.get(name, packed.doc_fields.get(name))
    return arrays


class Session:
    """One run's model, compiled step, state, checkpointer and metrics file."""

    def __init__(self, cfg: RunConfig, model: Transformer, loss: Any):
        self.cfg = cfg
        self.output_dir = Path(cfg.output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        (self.output_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
        self.graphdef, params = nnx.split(model)
        self.mesh = make_mesh(cfg.mesh.data)
        tx = make_optimizer(cfg.optimizer, cfg.max_steps)
        self.step_fn = TrainStep(
            self._bind(loss),
            tx,
            self.mesh,
            learning_rate=learning_rate_schedule(cfg.optimizer, cfg.max_steps),
            max_grad_norm=cfg.optimizer.max_grad_norm,
            docs_per_step=cfg.schedule.docs_per_step,
        )
        self.state = self.step_fn.replicate(TrainState.create(params, tx, cfg.seed))
        self.checkpointer = Checkpointer(self.output_dir / "checkpoints", keep=cfg.checkpoint.keep)
        self.console = Console(stderr=True)
        self.started = time.perf_counter()

    def _bind(self, loss: Any) -> LossFn:
        graphdef = self.graphdef

        def loss_fn(params: Any, mb: dict[str, jax.Array]) -> LossTerms:
            return loss(nnx.merge(graphdef, params), mb)

        return loss_fn

    @property
    def model(self) -> Transformer:
        """The current parameters as a model (for evaluation and export)."""
        return nnx.merge(self.graphdef, self.state.params)

    @property
    def step(self) -> int:
        return int(self.state.step)

    def resume(self, host_template: dict[str, Any]) -> dict[str, Any] | None:
        """Restore the newest checkpoint if resuming is on; returns its host state or None."""
        if not self.cfg.checkpoint.resume or self.checkpointer.latest_step() is None:
            self.writer = MetricsWriter(self.output_dir, resume_step=None)
            return None
        state, host = self.checkpointer.restore(self.state)
        self.state = self.step_fn.replicate(state)
        self.writer = MetricsWriter(self.output_dir, resume_step=self.step)
        self.console.print(f"resumed from step {self.step} ({self.checkpointer.directory})")
        return host

    def run_step(
        self, arrays: dict[str, np.ndarray], expected_documents: int, rounds: int | None = None
    ) -> dict[str, Any]:
        """Shard, step, and check the device's document count against the host's plan.

        ``rounds`` (the packed batch's real micro-batches per rank) bounds the device loop, so
        bucket padding slots cost nothing; ``None`` runs every slot.
        """
        batch = self.step_fn.shard_batch(arrays)
        self.state, metrics = self.step_fn(self.state, batch, 0, rounds)
        row = to_python(metrics)
        if row["num_documents"] != expected_documents:
            raise RuntimeError(
                f"internal error: step {self.step} consumed {row['num_documents']} documents "
                f"on device but the host planned {expected_documents}"
            )
        row.pop("cursor")
        row["step"] = self.step
        row["compiles"] = self.step_fn.compiles
        row["elapsed_s"] = round(time.perf_counter() - self.started, 3)
        return row

    def maybe_checkpoint(self, host: dict[str, Any], *, force: bool = False) -> None:
        every = self.cfg.checkpoint.every
        if force or (every and self.step % every == 0):
            self.checkpointer.save(self.step, self.state, host)

    def eval_due(self) -> bool:
        """Evaluate after this step: every ``logging.eval_every`` steps and after the last."""
        every = self.cfg.logging.eval_every
        return bool(every and self.step % every == 0) or self.step == self.cfg.max_steps

    def record(self, row: dict[str, Any], host: dict[str, Any], *, final: bool = False) -> None:
        """Write the step's metrics row, then checkpoint if due (always after the last step, or
        when ``final`` says the run ends here)."""
        self.writer.write(row)
        self.maybe_checkpoint(host, force=final or self.step == self.cfg.max_steps)

    @contextlib.contextmanager
    def progress(self, description: str) -> Iterator[Any]:
        """A rich progress bar over optimizer steps (disabled by ``logging.progress: false``)."""
        bar = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            console=self.console,
            disable=not self.cfg.logging.progress,
        )
        with bar:
            task = bar.add_task(description, total=self.cfg.max_steps, completed=self.step, info="")

            def advance(info: str) -> None:
                bar.update(task, completed=self.step, info=info)

            yield advance

    def export(self, tokenizer: TextTokenizer) -> Path:
        """Write the current model and its tokenizer as an HF directory ``<output_dir>/hf``."""
        path = self.output_dir / "hf"
        save_pretrained(self.model, path)
        tokenizer.save(path)
        return path

    def close(self) -> None:
        self.checkpointer.close()
