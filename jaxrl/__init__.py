"""jaxrl: exact, layout-invariant RL and preference fine-tuning of language models in JAX.

The public API a notebook or a script uses is this module's names (``__all__``), plus the
documented subpackage entry points (``jaxrl.models.from_pretrained``, ``jaxrl.data.load_tokenizer``,
``jaxrl.data.schedule.build_dp_schedule``, ``jaxrl.losses``):

- configs: ``load_config`` (a YAML file + ``key=value`` overrides → ``RunConfig``), the section
  classes (``GRPOConfig``, ``DPOConfig``, ``KTOConfig``, ``PPOConfig``, ``SFTConfig``,
  ``WarmStartConfig``), ``ConfigError``, and ``configs.path(name)``: a shipped YAML file
  (``jaxrl.configs``; not to be confused with ``jaxrl.config``, the classes);
- training: ``run(cfg)`` (what ``jaxrl train`` runs), ``warm_start(cfg)`` (the SFT warm
  start), and the trainers ``SFTTrainer``, ``GRPOTrainer``, ``DPOTrainer``, ``KTOTrainer``,
  ``PPOTrainer`` (``Trainer(cfg).run()`` → summary; ``.evaluate()`` → held-out metrics);
- results: ``read_metrics(path)`` (the rows of a ``metrics.jsonl``);
- evaluation: ``sample(model_dir, prompts)`` (completions of a policy), ``HeldoutEvaluator``
  (greedy and sampled accuracy of parameters on held-out prompts), ``build_task(cfg)`` (the
  built-in task's problems).

Every name is imported on first use, so ``import jaxrl`` (and the command line, which handles
Ctrl-C from its first moment) stays light: no jax, no trainer is imported until one is used.

Array names carry their shape as axis letters (``logits_BTV``, ``tokens_RMT``); the letters are
defined once, in docs/shapes.md (B rows, T tokens, D width, V vocabulary, H / K query / kv heads,
M micro-batch slots, R data-parallel ranks, G generations per prompt, S segment slots, ...).
Segment ids are 1-based documents within a row; 0 marks padding. Positions restart at 0 for
every document.
"""

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

# public name -> "module:attribute" (or "module" for a module), imported on first use
PUBLIC = {
    "ConfigError": "jaxrl.config:ConfigError",
    "RunConfig": "jaxrl.config:RunConfig",
    "GRPOConfig": "jaxrl.config:GRPOConfig",
    "DPOConfig": "jaxrl.config:DPOConfig",
    "KTOConfig": "jaxrl.config:KTOConfig",
    "PPOConfig": "jaxrl.config:PPOConfig",
    "SFTConfig": "jaxrl.config:SFTConfig",
    "WarmStartConfig": "jaxrl.config:WarmStartConfig",
    "load_config": "jaxrl.config:load_run_config",
    "configs": "jaxrl.configs",
    "run": "jaxrl.trainers:run",  # not ``train``: that is the engine's package, jaxrl.train
    "warm_start": "jaxrl.trainers.warm_start:warm_start",
    "SFTTrainer": "jaxrl.trainers.sft:SFTTrainer",
    "GRPOTrainer": "jaxrl.trainers.grpo:GRPOTrainer",
    "DPOTrainer": "jaxrl.trainers.dpo:DPOTrainer",
    "KTOTrainer": "jaxrl.trainers.kto:KTOTrainer",
    "PPOTrainer": "jaxrl.trainers.ppo:PPOTrainer",
    "read_metrics": "jaxrl.train.run_io.metrics:read_metrics",
    "sample": "jaxrl.policy:sample",
    "Samples": "jaxrl.policy:Samples",
    "HeldoutEvaluator": "jaxrl.rollout.heldout:HeldoutEvaluator",
    "HeldoutResult": "jaxrl.rollout.heldout:HeldoutResult",
    "build_task": "jaxrl.train.build:build_task",
}

__all__ = ["__version__", *PUBLIC]


def __getattr__(name: str) -> Any:
    """A public name, imported on first use (``PUBLIC``)."""
    target = PUBLIC.get(name)
    if target is None:
        raise AttributeError(f"module 'jaxrl' has no attribute {name!r}")
    module, _, attr = target.partition(":")
    value = import_module(module)
    if attr:
        value = getattr(value, attr)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *PUBLIC})
