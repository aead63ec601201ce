"""What every trainer shares around the run ``jaxrl.train.build`` builds (mesh, model, state,
compiled step): output directory, checkpoints and resuming, metrics, progress, the step planner,
the step loop (``Session.loop``, which ``trainers.algorithm.Algorithm.run`` drives through the
trainer contract) and the run's end (export, final evaluation, summary).

Orchestration only; the numerics live in losses/ and train/ (the objectives in
``jaxrl.train.objectives``). With several processes every
process runs the same session; only process 0 writes config.json, metrics.jsonl and exports
(orbax checkpoints are written by all, as orbax intends).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from jaxrl.config import ConfigError, RunConfig, to_dict
from jaxrl.data.batching.shared_prompt import plan_shared_batch
from jaxrl.data.batching.step_plan import StepBatch, plan_device_batch
from jaxrl.data.tokenizer import TextTokenizer
from jaxrl.models import lora
from jaxrl.models.adapters.peft import save_adapters
from jaxrl.models.hf import checkpoint_dtype, read_generation_config, save_pretrained
from jaxrl.models.transformer import Transformer
from jaxrl.rollout.pipeline import generation_device_count
from jaxrl.runtime import launch, storage
from jaxrl.runtime.compile_cache import (
    cache_counts,
    enable_compile_cache,
    remember,
    remembered,
)
from jaxrl.runtime.mesh import (
    barrier,
    batch_ranks,
    is_primary,
    local_ranks,
    resolve_shape,
    run_devices,
)
from jaxrl.train.build import build_run, exact_base
from jaxrl.train.objectives import Objective
from jaxrl.train.precision import AUTO, auto_dtype_note, compute_copy, lost_update_fraction
from jaxrl.train.run_io.checkpoint import Checkpointer, nonfinite_leaves
from jaxrl.train.run_io.metrics import MetricsWriter, to_python
from jaxrl.train.run_io.preemption import Preempted, PreemptionWatch
from jaxrl.trainers.counters import CompileWatch, HostCounters
from jaxrl.trainers.layout_change import layout_change_line, model_change_error, model_changes

__all__ = ["Session", "generation_devices", "with_device_ranks"]

_ANNOUNCED: list[str] = []  # the dtype model.dtype=auto resolved to, once said


def with_device_ranks(cfg: RunConfig) -> RunConfig:
    """``cfg`` with its batch sections' world size taken from the devices the run uses when a
    mesh axis is -1 (a config touches no device: ``RunConfig.with_batch_ranks``); ``ConfigError``
    when the mesh does not fit the devices or the sections' batches do not fit the ranks.
    Resolved once: a config whose sections know their world size (a fixed mesh, resolved when
    the config was loaded, or an earlier call) comes back as it is, devices untouched."""
    launch.join(cfg.distributed, cfg.mesh)  # the Python API starts the job as the CLI does
    if cfg.batch_ranks_known:
        return cfg
    devices = len(run_devices((*cfg.mesh.sizes, cfg.mesh.expert)))
    devices -= generation_devices(cfg, devices)
    data, fsdp, _ = resolve_shape(*cfg.mesh.sizes, devices, expert=cfg.mesh.expert)
    return cfg.with_batch_ranks(data * fsdp)


def step_family(cfg: RunConfig, devices: int) -> str:
    """The name the train step's batch shapes are remembered under (``precompile_steps``): a
    hash of what its programs depend on (the model, mesh, schedule, optimizer and algorithm
    sections, the device count, jax's version), not of the seed, the data or the outputs."""
    c = to_dict(cfg)
    parts = {k: c.get(k) for k in ("algorithm", "model", "mesh", "schedule", "optimizer")}
    parts.update(method=c.get(cfg.algorithm), devices=devices, jax=jax.__version__)
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()
    return f"train-step-{cfg.algorithm}-{digest[:16]}"


def generation_devices(cfg: RunConfig, pool: int) -> int:
    """Devices of a pool of ``pool`` that a GRPO run sets aside for asynchronous generation
    (``rollout``; ``jaxrl.rollout.pipeline.generation_device_count``), 0 for other runs."""
    if not cfg.samples_rollouts:
        return 0
    r = cfg.rollout
    count = generation_device_count(r.max_staleness, r.devices, pool)
    if count >= pool > 1:
        raise ConfigError(
            f"rollout.devices={count} sets {count} of the {pool} devices aside for generation, "
            "which leaves none to train on: use fewer"
        )
    return count


class CheckpointError(RuntimeError):
    """No checkpoint in the output directory can be restored."""


class NonFiniteError(RuntimeError):
    """Too many optimizer steps in a row had a non-finite loss or gradient."""


def _read_json(path: epath.Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def lost_updates_warning(params: Any, learning_rate: float) -> str:
    """The start-up warning of a bf16 master rounded to nearest: how many elements lose their
    update at the peak learning rate."""
    lost = lost_update_fraction(params, learning_rate)
    return (
        f"warning: model.param_dtype=bfloat16 with optimizer.master_rounding=nearest: at "
        f"learning rate {learning_rate:g}, an AdamW update is under half a bf16 ulp, and is "
        f"lost, for {lost:.1%} of the parameter elements; use model.param_dtype=float32 (an "
        "fp32 master) or optimizer.master_rounding=stochastic to keep them"
    )


def make_output_dir(path: epath.Path) -> None:
    """Create the run directory, or raise a ``ConfigError`` naming ``output_dir`` when a file
    stands where it (or one of its parents) should be, or it cannot be written. A URL needs no
    directory (an object store has none)."""
    if storage.is_remote(path):
        return
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        blocking = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), path)
        raise ConfigError(
            f"output_dir={str(path)!r} is invalid: {str(blocking)!r} is a file, not a "
            "directory; name a directory for the run (it is created if missing)"
        ) from None
    except PermissionError:
        raise ConfigError(
            f"output_dir={str(path)!r} is invalid: permission denied creating it; choose a "
            "directory you can write"
        ) from None


class Session:
    """One run (``build_run``: mesh, model, state, compiled step) with its output directory,
    checkpointer and metrics file."""

    def __init__(self, cfg: RunConfig, vocab_size: int, objective: Objective | None):
        """``objective``: what the train step minimises (``jaxrl.train.objectives``); None for
        a session that never trains (e.g. one that only exports)."""
        self.cfg = cfg
        self.vocab_size = vocab_size
        launch.join(cfg.distributed, cfg.mesh)  # the distributed section, from Python too
        enable_compile_cache(cfg.compile_cache)  # before anything compiles
        self.output_dir = storage.path(cfg.output_dir)  # a local path or a URL (gs://...)
        self.primary = is_primary()
        previous = self.output_dir / "config.json"  # the last run's, before it is replaced
        self.previous_config = _read_json(previous) if previous.is_file() else None
        self._refuse_another_model()
        if self.primary:
            make_output_dir(self.output_dir)
        run = build_run(cfg, vocab_size, objective)
        self.mesh, self.model_config, self.graphdef = run.mesh, run.model_config, run.graphdef
        self.state, self.step_fn = run.state, run.step
        self.frozen = run.frozen  # LoRA: the frozen base; state.params are the adapters
        self.ranks = batch_ranks(self.mesh)  # data-parallel ranks: data × fsdp
        self.local_ranks = local_ranks(self.mesh)  # the ranks whose rows this process packs
        self.checkpointer = Checkpointer(self.output_dir / "checkpoints", keep=cfg.checkpoint.keep)
        self.console = Console(stderr=True)
        if cfg.model.dtype == AUTO and not _ANNOUNCED:  # once per process (a warm start too)
            _ANNOUNCED.append(self.model_config.dtype)
            self.say([auto_dtype_note(matmul_dtype=self.model_config.matmul_dtype)])
        if cfg.optimizer.master_rounding == "nearest":
            self.say([lost_updates_warning(self.state.params, cfg.optimizer.learning_rate)])
        self.counters = HostCounters()  # in every metrics row and every checkpoint
        self.programs = CompileWatch()  # the run's compiled programs: metric `compiles`
        self.programs.add("train step", self.step_fn)
        self.step_family = step_family(cfg, len(self.mesh.devices.flat))  # remembered shapes
        self._remembered = 0  # the step's signatures already added to them
        self.warned_empty = False
        self.preemption = PreemptionWatch()  # SIGTERM: save at an agreed step and stop
        self._saved_step: int | None = None  # the step the newest checkpoint holds
        self.started = time.perf_counter()

    def _refuse_another_model(self) -> None:
        """A resume onto a model of other parameter shapes is refused in one line naming the
        changed settings, from the previous run's config.json, before orbax reads anything."""
        directory = self.output_dir / "checkpoints"
        if not (self.cfg.checkpoint.resume and directory.is_dir()):
            return
        if not any(p.name.isdigit() for p in directory.iterdir()):  # committed steps only
            return
        line = model_change_error(self.previous_config, to_dict(self.cfg), self.cfg.output_dir)
        if line:
            raise ConfigError(line)

    @property
    def model(self) -> Transformer:
        """The current parameters as a model (for evaluation and export)."""
        return nnx.merge(self.graphdef, self.policy_params)

    @property
    def policy_params(self) -> Any:
        """The whole current model state for the scorer and the sampler: ``state.params``, or
        with LoRA the adapters joined to the frozen base (no copy)."""
        if self.frozen is None:
            return self.state.params
        return lora.join(self.state.params, self.frozen)

    def reference_params(self, *, copy: bool = True) -> Any:
        """The frozen reference of DPO / GRPO with beta > 0, taken now (before any update): a
        compute-dtype copy of the parameters (``copy=False``: the parameters themselves, for a
        use that ends before the next step), or with LoRA the same model with its adapters
        disabled (zeroed: the base exactly, no second copy of the weights)."""
        if self.frozen is None:
            if not copy:
                return self.state.params
            return compute_copy(self.state.params, self.model_config.dtype)
        return lora.join(lora.disabled(self.state.params), self.frozen)

    @property
    def step(self) -> int:
        return int(self.state.step)

    def resume(self, host_template: dict[str, Any]) -> dict[str, Any] | None:
        """Restore the newest usable checkpoint if resuming is on; returns its host state or
        None. A checkpoint that cannot be read, or holds non-finite values, is reported in one
        line and the previous one is tried; when none is usable the run stops with an error."""
        steps = self.checkpointer.steps() if self.cfg.checkpoint.resume else []
        if not steps:
            self._write_config()
            self.writer = self._metrics_writer(None)
            return None
        problems = []
        for step in steps:
            self._check_layer_layout(step)
            try:
                state, host = self.checkpointer.restore(self.state, step)
            except Exception as e:  # damaged files: orbax raises many kinds
                problems.append(f"step {step}: unreadable ({type(e).__name__}: {e})".split("\n")[0])
                self.console.print(f"checkpoint {problems[-1]}; trying an older one")
                continue
            bad = nonfinite_leaves(state.params) + nonfinite_leaves(state.opt_state)
            if bad:
                problems.append(f"step {step}: non-finite values in {bad[:3]}")
                self.console.print(f"checkpoint {problems[-1]}; trying an older one")
                continue
            self.state = self.step_fn.place(state)
            self.counters.load_state_dict(host.pop("counters", {}))
            self._write_config()
            self.writer = self._metrics_writer(step)
            self.console.print(f"resumed from step {step} ({self.checkpointer.directory})")
            current = to_dict(self.cfg)
            layout = layout_change_line(self.previous_config, current, step=step, ranks=self.ranks)
            self.say([layout] if layout else [])
            if step >= self.cfg.max_steps:
                self.console.print(
                    f"the checkpoint is at step {step} and max_steps={self.cfg.max_steps}: "
                    "nothing left to train; raise max_steps to continue"
                )
            return host
        self.checkpointer.close()
        changed = model_changes(self.previous_config, to_dict(self.cfg))
        cause = (
            f" The checkpoints were written by a run with a different model: {changed}."
            if changed
            else ""
        )
        raise CheckpointError(
            f"no usable checkpoint in {self.checkpointer.directory}: "
            + "; ".join(problems)
            + f".{cause} Set checkpoint.resume=false (or use another output_dir, or delete the "
            "directory) to start fresh"
        )

    def say(self, lines: list[str]) -> None:
        """Print lines (warnings gathered before the session existed) on process 0's console."""
        if self.primary:
            for line in lines:
                self.console.print(line, soft_wrap=True, markup=False)

    def _write_config(self) -> None:
        """``config.json`` of this run, once it is known to go ahead (a run refused for an
        incompatible checkpoint leaves the previous run's file, which the error compares to)."""
        if self.primary:
            text = json.dumps(to_dict(self.cfg), indent=2)
            storage.write_text(self.output_dir / "config.json", text)

    def _metrics_writer(self, resume_step: int | None) -> MetricsWriter:
        """metrics.jsonl (and the TensorBoard / W&B sinks of ``logging``) from ``resume_step``."""
        log = self.cfg.logging
        return MetricsWriter(
            self.output_dir,
            resume_step=resume_step,
            enabled=self.primary,
            tensorboard=log.tensorboard,
            wandb=log.wandb,
            run_config=to_dict(self.cfg),
        )

    def _check_layer_layout(self, step: int) -> None:
        """A checkpoint keeps the layer layout of the run that wrote it (stacked ``[N, ...]``
        parameters with ``model.scan_layers``, one entry per layer without); restoring it into
        the other layout is refused with the fix."""
        stacked = self.checkpointer.stacked_layers(step)
        scanned = self.model_config.scan_layers
        if stacked is None or stacked == scanned:
            return
        self.checkpointer.close()
        raise CheckpointError(
            f"the checkpoint at step {step} in {self.checkpointer.directory} was written with "
            f"model.scan_layers={str(stacked).lower()} but this run has "
            f"model.scan_layers={str(scanned).lower()}: orbax checkpoints keep the layer layout "
            f"of their run. Resume with model.scan_layers={str(stacked).lower()}, or start a "
            "new output_dir from an exported HF directory (model.path; HF files are the same "
            "in both layouts)"
        )

    def precompile_steps(self) -> None:
        """Compile ahead, on the background thread, the train-step programs a previous run of
        this config compiled: their batch shapes are remembered beside the persistent compile
        cache (none with it off), so the first step neither traces nor compiles them
        (docs/performance.md). Call once the state is placed (after ``resume``)."""
        for signature in remembered(self.step_family):
            try:
                self.step_fn.precompile(self.state, signature)
            except (TypeError, ValueError):  # an entry of another format: not ours to compile
                continue

    def _remember_steps(self) -> None:
        """Add the batch shapes this run's train step compiled to the remembered ones."""
        self._remembered = len(self.step_fn.signatures)
        kept = remembered(self.step_family)
        as_json = lambda sig: [[name, list(shape), dtype] for name, shape, dtype in sig]  # noqa: E731
        new = [j for sig in self.step_fn.signatures if (j := as_json(sig)) not in kept]
        if new:
            remember(self.step_family, kept + new)

    def plan(self, ids: Any, *, all_ranks: bool = False, **documents: Any) -> StepBatch:
        """The step planner on this session's ranks: ``plan_device_batch(ids, **documents)``
        packing this process's ranks (every rank with ``all_ranks``)."""
        local = None if all_ranks else self.local_ranks
        return plan_device_batch(
            ids, ranks=self.ranks, schedule=self.cfg.schedule, local_ranks=local, **documents
        )

    def plan_shared(self, ids: Any, *, all_ranks: bool = False, **documents: Any) -> StepBatch:
        """:meth:`plan` in the shared-prompt layout (``grpo.shared_prompt_packing``:
        ``jaxrl.data.batching.shared_prompt.plan_shared_batch``; ``documents`` add
        ``prompt_lengths`` and ``group_keys``)."""
        local = None if all_ranks else self.local_ranks
        return plan_shared_batch(
            ids, ranks=self.ranks, schedule=self.cfg.schedule, local_ranks=local, **documents
        )

    def train_on(self, batch: StepBatch, *, empty_cause: str = "") -> dict[str, Any]:
        """One optimizer step on a planned batch; its metrics row. ``empty_cause``: why the
        batch may hold no loss token, and the fix (for the warning of an empty step)."""
        return self.run_step(
            batch.arrays, batch.num_documents, rounds=batch.rounds, empty_cause=empty_cause
        )

    def run_step(
        self,
        arrays: dict[str, np.ndarray],
        expected_documents: int,
        rounds: int | None = None,
        *,
        empty_cause: str = "",
    ) -> dict[str, Any]:
        """Shard, step, and check the device's document count against the host's plan.

        ``rounds`` (the packed batch's real micro-batches per rank) bounds the device loop, so
        bucket padding slots cost nothing; ``None`` runs every slot. A step with no loss token
        or a zero denominator has a zero gradient: it is counted (``empty_steps``) and the
        first one is warned about with ``empty_cause``.
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
        skipped, counters = bool(row["update_skipped"]), self.counters
        counters.nonfinite_steps += skipped
        counters.nonfinite_in_row = counters.nonfinite_in_row + 1 if skipped else 0
        row["nonfinite_steps"] = counters.nonfinite_steps
        if row["num_loss_tokens"] == 0 or row["denominator"] == 0:
            counters.empty_steps += 1
            if not self.warned_empty:
                self.warned_empty = True
                self.say(
                    [
                        f"warning: step {self.step} had no loss token "
                        f"({row['num_documents']} documents, denominator "
                        f"{row['denominator']:g}): its gradient is zero and only the "
                        "optimizer's momentum moved the weights (empty_steps counts such steps). "
                        + (empty_cause or "Check that the data's loss masks select tokens")
                    ]
                )
        row["empty_steps"] = counters.empty_steps
        row["step"] = self.step
        row["row_len"] = int(arrays["tokens"].shape[-1])  # T: the step's row-length bucket
        row["compiles"] = self.programs.total
        row["compile_cache_hits"] = cache_counts()["hits"]  # programs read from compile_cache
        self.say(self.programs.news(self.step))
        if len(self.step_fn.signatures) > self._remembered:  # the next run compiles it ahead
            self._remember_steps()
        row["elapsed_s"] = round(time.perf_counter() - self.started, 3)
        return row

    def maybe_checkpoint(
        self,
        host: Callable[[], dict[str, Any]],
        *,
        force: bool = False,
        save_state: Callable[[int], None] | None = None,
    ) -> None:
        """Save a checkpoint when due (``checkpoint.every``) or ``force``d; ``host()`` gives the
        trainer's host state, asked for only then, saved with the session's counters;
        ``save_state(step)`` first saves the trainer's device state beside it (PPO's critic)."""
        every = self.cfg.checkpoint.every
        if force or (every and self.step % every == 0):
            if save_state is not None:
                save_state(self.step)
            state = {**host(), "counters": self.counters.state_dict()}
            self.checkpointer.save(self.step, self.state, state)
            self._saved_step = self.step

    def eval_due(self) -> bool:
        """Evaluate after this step: every ``logging.eval_every`` steps and after the last."""
        every = self.cfg.logging.eval_every
        return bool(every and self.step % every == 0) or self.step == self.cfg.max_steps

    def record(
        self,
        row: dict[str, Any],
        host: Callable[[], dict[str, Any]],
        *,
        final: bool = False,
        save_state: Callable[[int], None] | None = None,
    ) -> None:
        """Write the step's metrics row, then checkpoint if due (always after the last step, or
        when ``final`` says the run ends here). After ``optimizer.max_nonfinite_steps``
        non-finite steps in a row it raises ``NonFiniteError`` instead of checkpointing, so the
        newest checkpoint is the last good state."""
        self.writer.write(row)
        limit = self.cfg.optimizer.max_nonfinite_steps
        if self.counters.nonfinite_in_row >= limit:
            latest = self.checkpointer.latest_step()
            kept = f"step {latest} in {self.checkpointer.directory}" if latest else "none yet"
            self.checkpointer.close()
            raise NonFiniteError(
                f"steps {self.step - limit + 1}-{self.step} all had a non-finite loss or gradient "
                f"(loss={row.get('loss')}, grad_norm={row.get('grad_norm')}), so their updates "
                f"were skipped and the run stops (optimizer.max_nonfinite_steps={limit}); last "
                f"checkpoint: {kept}. Check the model weights and data for NaN/inf, or lower "
                "optimizer.learning_rate"
            )
        force = final or self.step == self.cfg.max_steps
        self.maybe_checkpoint(host, force=force, save_state=save_state)

    def loop(
        self,
        description: str,
        step: Callable[[], dict[str, Any]],
        *,
        host_state: Callable[[], dict[str, Any]],
        save_state: Callable[[int], None] | None = None,
        evaluate: Callable[[], dict[str, Any]] | None = None,
        info: Callable[[dict[str, Any]], str] = lambda row: f"loss {row['loss']:.3f}",
        stop: Callable[[dict[str, Any]], bool] | None = None,
        epoch: Callable[[], float | None] | None = None,
        first_row: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The loop ``Algorithm.run`` drives: step, evaluate when due, record (and checkpoint:
        ``host_state()`` and ``save_state(step)``), until ``max_steps`` or ``stop(row)``;
        returns the last row ({} when nothing was left). ``epoch``: passes over the training
        data so far (None: not logged), logged as ``epoch`` in every row (the data wraps into a
        new, reshuffled epoch when a step needs more than is left).
        ``first_row``: fields added to the run's first row, step 1 (e.g. the data's length
        report); a resumed run has written it already."""
        last: dict[str, Any] = {}
        extra = dict(first_row or {}) if self.step == 0 else {}
        with self.progress(description) as advance:
            while self.step < self.cfg.max_steps:
                row = step()
                row.update(extra)
                extra.clear()
                if epoch is not None and (passes := epoch()) is not None:
                    row["epoch"] = round(passes, 6)
                if evaluate is not None and self.eval_due():
                    row.update(evaluate())
                done = stop is not None and stop(row)
                self.record(row, host_state, final=done, save_state=save_state)
                advance(info(row))
                last = row
                if done:
                    break
                self._stop_if_preempted(host_state, save_state)
        return last

    def _stop_if_preempted(
        self, host: Callable[[], dict[str, Any]], save_state: Callable[[int], None] | None
    ) -> None:
        """After a step: when a preemption notice came (``PreemptionWatch.due``: the same step
        on every process), save this step unless just saved, close, and raise ``Preempted``."""
        if self.step >= self.cfg.max_steps or not self.preemption.due(self.step):
            return
        if self._saved_step != self.step:
            self.maybe_checkpoint(host, force=True, save_state=save_state)
        self.close()
        raise Preempted(self.step)

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
            disable=not (self.cfg.logging.progress and self.primary),
        )
        with bar:
            task = bar.add_task(description, total=self.cfg.max_steps, completed=self.step, info="")

            def advance(info: str) -> None:
                bar.update(task, completed=self.step, info=info)

            yield advance

    def export(self, tokenizer: TextTokenizer) -> epath.Path:
        """Write the current model and its tokenizer as an HF directory ``<output_dir>/hf``
        (parameters gathered by every process, written by process 0).

        The weights are written in ``export.dtype`` (None: the dtype of the ``model.path``
        checkpoint, or ``model.param_dtype`` for a fresh model), so fp32 masters of a bf16
        checkpoint go back as bf16 and an fp32 checkpoint stays fp32 whatever the compute
        dtype. generation_config.json (the source's, with the tokenizer's ids) makes
        transformers' ``generate()`` stop where jaxrl's sampler does. A LoRA run also writes
        its adapters in PEFT's format to ``<output_dir>/adapter`` (``jaxrl.models.adapters.peft``;
        not for a MoE model, whose per-expert adapters PEFT cannot hold) and exports the merged
        model (``W + scaling · A B``, a quantised base dequantised) as
        ``hf``, with ``W`` and every untouched weight read again in their original precision
        (``train.build.exact_base``), so ``hf`` is PEFT's merge of the base and ``adapter``.
        With a URL output_dir the files are written locally and uploaded (``storage.staged``).
        """
        path = self.output_dir / "hf"
        source = self.cfg.model.path
        dtype = self.cfg.export.dtype or (source and checkpoint_dtype(source))
        base = read_generation_config(source) if source else {}
        model = self.model
        if self.frozen is not None:  # LoRA: the adapters alone (PEFT), then the merged model
            if not model.config.moe_layers:  # PEFT has no per-expert adapters: merged only
                with storage.staged(self.output_dir / "adapter") as adapter:
                    save_adapters(model, adapter, base_model=source)
            # onto the base as read, not the compute-dtype copy the steps used
            exact = exact_base(self.cfg, self.vocab_size, self.mesh)
            model = nnx.merge(self.graphdef, lora.join(self.state.params, exact))
            model = lora.merge(model, jnp.float32)
        with storage.staged(path) as local:
            save_pretrained(
                model,
                local,
                dtype=dtype or self.cfg.model.param_dtype,
                generation_config=tokenizer.generation_config(base),
            )
            if self.primary:
                tokenizer.save(local)
        barrier("export")  # other processes may read the export next (e.g. after a warm start)
        return path

    def finish(
        self,
        last: dict[str, Any],
        tokenizer: TextTokenizer,
        evaluate: Callable[[], dict[str, Any]],
        *,
        started: float,
    ) -> dict[str, Any]:
        """The end of every trainer's ``run()``: export (``export``), close, and the summary's
        common fields: ``steps``, ``final_loss``, the final held-out numbers (the ``eval/``
        fields of ``last``, the loop's last row, or else a fresh ``evaluate()``), ``wall_s``
        since ``started`` (``time.perf_counter``) and ``hf_export``."""
        export = self.export(tokenizer)
        self.close()
        final = {k: v for k, v in last.items() if k.startswith("eval/")} or evaluate()
        return {
            "steps": self.step,
            "final_loss": last.get("loss"),
            **final,
            "wall_s": round(time.perf_counter() - started, 1),
            "hf_export": str(export),
        }

    def close(self) -> None:
        self.preemption.close()
        self.checkpointer.close()
        if hasattr(self, "writer"):
            self.writer.close()
