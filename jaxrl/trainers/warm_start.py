"""SFT warm start inside a GRPO/DPO run: train ``sft_warmup_steps`` of SFT, then start there."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from jaxrl.config import RunConfig


def warm_start(cfg: RunConfig) -> RunConfig:
    """Run the SFT stage into ``<output_dir>/sft`` (resumable) and point ``model.path`` at it.

    With ``sft_warmup_steps == 0`` the config is returned unchanged (``model.path`` or a fresh
    model). The SFT stage uses the run's ``sft``, ``task``, ``model``, ``schedule`` and
    ``mesh`` sections; its export ``<output_dir>/sft/hf`` is the RL stage's starting point.
    """
    if cfg.sft_warmup_steps == 0:
        return cfg
    from jaxrl.trainers.sft import SFTTrainer

    sft_dir = Path(cfg.output_dir) / "sft"
    export = sft_dir / "hf"
    if not (export / "config.json").is_file():
        sft_cfg = dataclasses.replace(
            cfg,
            algorithm="sft",
            output_dir=str(sft_dir),
            max_steps=cfg.sft_warmup_steps,
            sft_warmup_steps=0,
            grpo={},
            dpo={},
        )
        SFTTrainer(sft_cfg).run()
    model = dataclasses.replace(cfg.model, path=str(export), init={})
    return dataclasses.replace(cfg, model=model, sft_warmup_steps=0)
