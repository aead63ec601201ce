"""The GRPO family's trainers (``trainer``: ``GRPOTrainer``, and ``RolloutTrainer`` that PPO's
trainer composes with its critic stage) and the rollout side they are built from, one concept
per module: the run's prompts (``data``), reward functions (``rewards``), the settings refused
(``checks``), the rollout parts built in one place (``builder``), the generation producer with
DAPO's dynamic sampling (``producer``), where generation reads the weights (``placement``), the
step's plan (``planning``), the rows' metrics (``metrics``) and the ``Stage`` an algorithm adds."""

from jaxrl.trainers.grpo.rewards import DEFAULT_REWARD_FUNCS, load_reward_funcs
from jaxrl.trainers.grpo.stage import Stage
from jaxrl.trainers.grpo.trainer import PLOT_NAME, GRPOTrainer, RolloutTrainer

__all__ = [
    "DEFAULT_REWARD_FUNCS",
    "PLOT_NAME",
    "GRPOTrainer",
    "RolloutTrainer",
    "Stage",
    "load_reward_funcs",
]
