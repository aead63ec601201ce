"""TRL's ``GRPOTrainer`` next to a jaxrl GRPO run (peer_grpo.py and real_model.py share it), in
two forms:

- :func:`plain_trainer`: TRL as its users run it, for speed: a stock ``GRPOTrainer`` (no
  subclass, TRL's own sampler and scheduler) with the run's GRPO fields and AdamW settings;
- :func:`same_schedule_trainer`: TRL made to follow the jaxrl run exactly, for comparing
  learning curves step by step:

The same prompts in the same order (TRL's ``RepeatSampler`` stream with jaxrl's per-epoch
permutation, ``repeat_sampler_indices``), the GRPO fields both frameworks name alike
(``SHARED_GRPO_FIELDS``), jaxrl's AdamW settings and its learning rate at every step (a
``LambdaLR`` over jaxrl's schedule: for ``cosine`` that is TRL's ``cosine_with_min_lr`` with
``min_lr_rate=min_lr_ratio``), fp32 on the CPU, and a callback that times every optimizer step
(wall and process CPU seconds).
"""

from __future__ import annotations

import resource
import time
from typing import Any

# GRPOConfig fields with the same name and meaning in jaxrl and TRL (top_k: None here, 0 there).
SHARED_GRPO_FIELDS = (
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "num_generations",
    "generation_batch_size",
    "steps_per_generation",
    "num_iterations",
    "shuffle_dataset",
    "max_completion_length",
    "temperature",
    "top_p",
    "epsilon",
    "epsilon_high",
    "delta",
    "beta",
    "loss_type",
    "importance_sampling_level",
    "scale_rewards",
    "reward_weights",
    "multi_objective_aggregation",
    "mask_truncated_completions",
    "top_entropy_quantile",
)


def cpu_seconds() -> float:
    """User + system CPU time of this process, all threads."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _timer(steps: list[dict[str, float]]) -> Any:
    """A callback that appends ``{"wall_s", "cpu_s"}`` of every optimizer step to ``steps``."""
    from transformers import TrainerCallback

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.w0, self.c0 = time.perf_counter(), cpu_seconds()

        def on_step_end(self, args, state, control, **kw):
            steps.append(
                {"wall_s": time.perf_counter() - self.w0, "cpu_s": cpu_seconds() - self.c0}
            )

    return Timer()


def _args(grpo: dict[str, Any], optimizer: dict[str, Any], **kw: Any) -> Any:
    """``trl.GRPOConfig`` with the shared GRPO fields and jaxrl's AdamW settings, fp32 on CPU."""
    import trl

    g = grpo
    return trl.GRPOConfig(
        **{k: g[k] for k in SHARED_GRPO_FIELDS if k != "steps_per_generation"},
        top_k=g["top_k"] or 0,
        learning_rate=optimizer["learning_rate"],
        adam_beta1=optimizer["b1"],
        adam_beta2=optimizer["b2"],
        adam_epsilon=optimizer["eps"],
        weight_decay=optimizer["weight_decay"],
        max_grad_norm=optimizer["max_grad_norm"],
        optim="adamw_torch",
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        use_vllm=False,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        **kw,
    )


def plain_trainer(
    *,
    grpo: dict[str, Any],
    optimizer: dict[str, Any],
    seed: int,
    max_steps: int,
    output_dir: str,
    **trainer_kwargs: Any,
) -> tuple[Any, list[dict[str, float]]]:
    """``(trainer, step_times)``: a stock ``trl.GRPOTrainer`` (TRL's own prompt sampler, its
    ``constant_with_warmup`` schedule over ``optimizer["warmup_steps"]``), the same GRPO fields
    and AdamW settings as the jaxrl run, fp32 on the CPU; only a timing callback is added."""
    import trl

    steps: list[dict[str, float]] = []
    args = _args(
        grpo,
        optimizer,
        output_dir=output_dir,
        max_steps=max_steps,
        seed=seed,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=int(optimizer.get("warmup_steps", 0)),
    )
    callbacks = [*trainer_kwargs.pop("callbacks", []), _timer(steps)]
    return trl.GRPOTrainer(args=args, callbacks=callbacks, **trainer_kwargs), steps


def same_schedule_trainer(
    *,
    grpo: dict[str, Any],
    optimizer: dict[str, Any],
    lr: list[float],
    seed: int,
    max_steps: int,
    output_dir: str,
    **trainer_kwargs: Any,
) -> tuple[Any, list[dict[str, float]]]:
    """``(trainer, step_times)``: a TRL ``GRPOTrainer`` that follows the jaxrl run whose
    resolved GRPO fields are ``grpo``, AdamW settings ``optimizer`` and per-step learning rates
    ``lr``; ``trainer_kwargs`` are GRPOTrainer's own (model, reward_funcs, train_dataset,
    processing_class). ``step_times`` fills with ``{"wall_s", "cpu_s"}`` per optimizer step."""
    import torch
    import trl
    from torch.utils.data import Sampler

    from jaxrl.rollout.buffer import repeat_sampler_indices

    g = grpo

    class JaxrlOrder(Sampler):
        """TRL's RepeatSampler index stream with jaxrl's per-epoch permutation."""

        def __init__(self, n: int):
            self.n, self.epoch = n, 0
            self.kw = dict(
                mini_repeat_count=g["num_generations"],
                batch_size=g["generation_batch_size"] // g["num_generations"],
                repeat_count=g["num_iterations"] * g["steps_per_generation"],
                shuffle=g["shuffle_dataset"],
                seed=seed,
            )

        def set_epoch(self, epoch: int) -> None:
            self.epoch = epoch

        def __iter__(self):
            indices = repeat_sampler_indices(self.n, epoch=self.epoch, **self.kw)
            self.epoch += 1
            return iter(indices)

        def __len__(self) -> int:
            return len(repeat_sampler_indices(self.n, epoch=0, **self.kw))

    class SameScheduleGRPOTrainer(trl.GRPOTrainer):
        def _get_train_sampler(self, dataset=None):
            return JaxrlOrder(len(dataset if dataset is not None else self.train_dataset))

        def create_scheduler(self, num_training_steps, optimizer=None):
            if self.lr_scheduler is None:  # jaxrl's learning rate at every step
                factor = [x / optimizer_settings["learning_rate"] for x in lr]
                self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
                    optimizer or self.optimizer, lambda k: factor[min(k, len(factor) - 1)]
                )
            return self.lr_scheduler

    optimizer_settings = optimizer
    steps: list[dict[str, float]] = []
    args = _args(
        g,
        optimizer,
        output_dir=output_dir,
        max_steps=max_steps,
        seed=seed,
        dataloader_num_workers=0,
    )
    assert args.steps_per_generation == g["steps_per_generation"], "TRL resolved another S"
    callbacks = [*trainer_kwargs.pop("callbacks", []), _timer(steps)]
    trainer = SameScheduleGRPOTrainer(args=args, callbacks=callbacks, **trainer_kwargs)
    return trainer, steps
