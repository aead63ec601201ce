"""SFT warm start inside a GRPO/DPO run: SFT into ``<output_dir>/sft``, then start there."""

from __future__ import annotations

import dataclasses
import json

from jaxrl.config import RunConfig
from jaxrl.config.sections.model import LoraSection
from jaxrl.runtime import storage

SUMMARY = "warm_start.json"


def warm_start(cfg: RunConfig) -> RunConfig:
    """Run the SFT stage into ``<output_dir>/sft`` (resumable) and point ``model.path`` at it.

    Without ``warm_start.steps`` the config is returned unchanged (``model.path`` or a fresh
    model). The SFT stage uses the run's ``sft``, ``task``, ``model``, ``schedule``, ``mesh``
    and ``logging`` sections, ``optimizer`` with the warm start's own ``learning_rate``,
    ``warmup_steps`` and ``decay`` over it, and ``max_steps = warm_start.steps``. With
    ``warm_start.target > 0`` it checks the held-out exact match every
    ``warm_start.eval_every`` steps and stops at the first check that reaches the target
    (``warm_start.steps`` is then the cap), so the RL stage starts from a
    model of known quality rather than from wherever a fixed step count happened to land.
    Its export ``<output_dir>/sft/hf`` is the RL stage's starting point; ``sft/warm_start.json``
    records where the warm start stopped.
    """
    ws = cfg.warm_start
    if ws is None or not ws.enabled:
        return cfg
    from jaxrl.runtime.mesh import agreed, is_primary
    from jaxrl.trainers.sft import SFTTrainer

    sft_dir = storage.path(cfg.output_dir) / "sft"  # a local path or a URL
    export = sft_dir / "hf"
    if not agreed((export / "config.json").is_file()):  # process 0 decides for every process
        sft_cfg, target = warm_start_config(cfg), ws.target or None
        summary = SFTTrainer(sft_cfg, stop_at_accuracy=target).run()
        summary["target"] = ws.target
        if is_primary():
            storage.write_text(sft_dir / SUMMARY, json.dumps(summary, indent=2))
        if target is not None and is_primary():
            print(_target_line(summary, ws.steps, sft_dir / SUMMARY), flush=True)
    model = dataclasses.replace(cfg.model, path=str(export), init={})
    return dataclasses.replace(cfg, model=model, warm_start=dataclasses.replace(ws, steps=0))


def warm_start_config(cfg: RunConfig) -> RunConfig:
    """The SFT run of ``cfg``'s warm start (a config: nothing runs): ``algorithm: sft`` into
    ``<output_dir>/sft`` for ``warm_start.steps``, the run's ``sft`` section and ``optimizer``
    with the warm start's ``learning_rate`` / ``warmup_steps`` / ``decay`` over it, held-out
    checks every ``warm_start.eval_every`` steps with a target, and no other algorithm's
    section."""
    ws = cfg.warm_start
    sft = cfg.sft
    if cfg.mesh.static_batch_ranks is None:  # the SFT session counts its own ranks
        sft = dataclasses.replace(sft, world_size=None)
    sft_cfg = dataclasses.replace(
        cfg,
        algorithm="sft",
        output_dir=str(storage.path(cfg.output_dir) / "sft"),  # a local path or a URL
        max_steps=ws.steps,
        warm_start=None,
        optimizer=dataclasses.replace(cfg.optimizer, **ws.optimizer_changes()),
        sft=sft,
        **dict.fromkeys(("grpo", "dpo", "kto", "ppo")),  # an SFT run has its own section only
    )
    if cfg.model.path is None and cfg.model.lora.enabled:
        # adapters on a random base learn little: a fresh model is warm-started fully, and
        # the RL stage puts its adapters on the result (docs/lora.md)
        sft_cfg = dataclasses.replace(
            sft_cfg, model=dataclasses.replace(cfg.model, lora=LoraSection())
        )
    if ws.target:  # check the target every warm_start.eval_every steps
        logging = dataclasses.replace(cfg.logging, eval_every=ws.eval_every)
        sft_cfg = dataclasses.replace(sft_cfg, logging=logging)
    return sft_cfg


def _target_line(summary: dict, cap: int, record: object) -> str:
    """One line on whether the warm start reached ``summary["target"]``: the progress bar ends at
    the stop step, short of its cap, and says nothing of why."""
    accuracy, target, step = summary["eval/accuracy"], summary["target"], summary["steps"]
    if summary["stopped_at_target"]:
        return (
            f"SFT warm start reached its target at step {step} of at most {cap}: held-out "
            f"accuracy {accuracy:.3f} >= warm_start.target={target} ({record}); the RL stage "
            "starts from there"
        )
    return (
        f"warning: the SFT warm start reached held-out accuracy {accuracy:.3f} < "
        f"warm_start.target={target} within warm_start.steps={cap} ({record}); the RL stage "
        "starts from there"
    )
