"""A GRPO-family run's prompts, read and checked once (``GRPOData``)."""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxrl.config import STAGE_SECTIONS, ConfigError, GRPOConfig, RunConfig
from jaxrl.data.datasets import Dataset
from jaxrl.data.documents import grpo_prompts
from jaxrl.data.tasks import Example
from jaxrl.rollout.tools.toolbox import Toolbox
from jaxrl.trainers.preamble import Preamble

__all__ = ["GRPOData"]


@dataclasses.dataclass
class GRPOData:
    """A GRPO run's prompts: rows (every column but ``prompt`` goes to the reward functions)
    and prompt ids (chat template and tool schemas applied; over ``grpo.max_prompt_length``
    keep their last tokens, counted in the preamble's report)."""

    train_rows: list[dict]
    train_prompts: list[np.ndarray]
    eval_rows: list[dict]
    eval_prompts: list[np.ndarray]
    columns: list[str]  # the reward functions' extra columns

    @classmethod
    def load(cls, pre: Preamble, config: GRPOConfig, toolbox: Toolbox | None) -> GRPOData:
        cfg = pre.cfg
        key = STAGE_SECTIONS[cfg.algorithm]  # grpo, or ppo.actor
        limit = config.max_prompt_length or 2**31 - 1
        tools = toolbox.schemas if toolbox is not None else None

        def prompts(split: str, data: Dataset) -> tuple[list[dict], list[np.ndarray]]:
            made = grpo_prompts(data, pre.tokenizer, max_prompt_length=limit, tools=tools)
            pre.report(split, made.report, f"{key}.max_prompt_length={limit}")
            return data.rows, made.ids

        splits = pre.datasets("grpo")
        train_rows, train_prompts = prompts("train", splits["train"])
        eval_rows, eval_prompts = prompts("eval", splits["eval"]) if "eval" in splits else ([], [])
        if not cfg.logging.eval_rewards and any("answer" not in r for r in eval_rows):
            raise ConfigError(
                f"data.eval={cfg.data.eval!r} is invalid for GRPO: held-out accuracy scores "
                "completions against an 'answer' column, which its rows lack; add one, set "
                "logging.eval_rewards: true (held-out scores from the run's reward functions), "
                "or leave data.eval out"
            )
        columns = list(dict.fromkeys(k for r in train_rows for k in r if k != "prompt"))
        data = cls(train_rows, train_prompts, eval_rows, eval_prompts, columns)
        data.check(cfg, config)
        return data

    def check(self, cfg: RunConfig, config: GRPOConfig) -> None:
        """A prompt plus the completion fits one row; a generation's prompts are distinct."""
        key = STAGE_SECTIONS[cfg.algorithm]  # grpo, or ppo.actor
        longest = max(len(p) for p in self.train_prompts + self.eval_prompts)
        if longest + config.max_completion_length > cfg.schedule.max_tokens:
            raise ConfigError(
                f"schedule.max_tokens={cfg.schedule.max_tokens} is invalid: a prompt of {longest} "
                f"tokens plus {key}.max_completion_length={config.max_completion_length} must "
                "fit one row; raise schedule.max_tokens or lower max_completion_length"
            )
        if config.prompts_per_generation > len(self.train_prompts):
            raise ConfigError(
                f"{key}.generation_batch_size={config.generation.size} is invalid: a "
                f"generation takes {config.prompts_per_generation} prompts (× "
                f"{config.num_generations} completions) but the training data holds "
                f"{len(self.train_prompts)}; lower the batch size or add data"
            )

    def examples(self, split: str) -> list[Example]:
        """The built-in task's problems of ``split`` (notebooks and benchmarks read them)."""
        rows = self.train_rows if split == "train" else self.eval_rows
        return [Example(r["prompt"], r["answer"]) for r in rows]
