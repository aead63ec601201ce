"""SFT warm start inside a GRPO/DPO run: SFT into ``<output_dir>/sft``, then start there."""

from __future__ import annotations

import dataclasses
import json

from jaxrl.config import RunConfig
from jaxrl.config.run import LoraSection
from jaxrl.runtime import storage

SUMMARY = "warm_start.json"


def warm_start(cfg: RunConfig) -> RunConfig:
    """Run the SFT stage into ``<output_dir>/sft`` (resumable) and point ``model.path`` at it.

    With ``sft_warmup_steps == 0`` the config is returned unchanged (``model.path`` or a fresh
    model). The SFT stage uses the run's ``sft``, ``task``, ``model``, ``schedule``, ``mesh``,
    ``optimizer`` and ``logging`` sections with ``max_steps = sft_warmup_steps``. With
    ``sft_warmup_target > 0`` it checks the held-out exact match every
    ``sft_warmup_eval_every`` steps and stops at the first check that reaches the target
    (``sft_warmup_steps`` is then the cap), so the RL stage starts from a
    model of known quality rather than from wherever a fixed step count happened to land.
    Its export ``<output_dir>/sft/hf`` is the RL stage's starting point; ``sft/warm_start.json``
    records where the warm start stopped.
    """
    if cfg.sft_warmup_steps == 0:
        return cfg
    from jaxrl.runtime.mesh import agreed, is_primary
    from jaxrl.trainers.sft import SFTTrainer

    sft_dir = storage.path(cfg.output_dir) / "sft"  # a local path or a URL
    export = sft_dir / "hf"
    if not agreed((export / "config.json").is_file()):  # process 0 decides for every process
        sft_cfg = dataclasses.replace(
            cfg,
            algorithm="sft",
            output_dir=str(sft_dir),
            max_steps=cfg.sft_warmup_steps,
            sft_warmup_steps=0,
            sft_warmup_target=0.0,
        )
        if cfg.model.path is None and cfg.model.lora.enabled:
            # adapters on a random base learn little: a fresh model is warm-started fully, and
            # the RL stage puts its adapters on the result (docs/lora.md)
            sft_cfg = dataclasses.replace(
                sft_cfg, model=dataclasses.replace(cfg.model, lora=LoraSection())
            )
        target = cfg.sft_warmup_target or None
        if target is not None:  # check the target every sft_warmup_eval_every steps
            logging = dataclasses.replace(cfg.logging, eval_every=cfg.sft_warmup_eval_every)
            sft_cfg = dataclasses.replace(sft_cfg, logging=logging)
        summary = SFTTrainer(sft_cfg, stop_at_accuracy=target).run()
        summary["target"] = cfg.sft_warmup_target
        if is_primary():
            storage.write_text(sft_dir / SUMMARY, json.dumps(summary, indent=2))
        if target is not None and is_primary():
            print(_target_line(summary, cfg.sft_warmup_steps, sft_dir / SUMMARY), flush=True)
    model = dataclasses.replace(cfg.model, path=str(export), init={})
    return dataclasses.replace(cfg, model=model, sft_warmup_steps=0, sft_warmup_target=0.0)


def _target_line(summary: dict, cap: int, record: object) -> str:
    """One line on whether the warm start reached ``summary["target"]``: the progress bar ends at
    the stop step, short of its cap, and says nothing of why."""
    accuracy, target, step = summary["eval/accuracy"], summary["target"], summary["steps"]
    if summary["stopped_at_target"]:
        return (
            f"SFT warm start reached its target at step {step} of at most {cap}: held-out "
            f"accuracy {accuracy:.3f} >= sft_warmup_target={target} ({record}); the RL stage "
            "starts from there"
        )
    return (
        f"warning: the SFT warm start reached held-out accuracy {accuracy:.3f} < "
        f"sft_warmup_target={target} within sft_warmup_steps={cap} ({record}); the RL stage "
        "starts from there"
    )
