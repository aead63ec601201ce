"""PPO's critic: the policy's backbone with an fp32 value head, its own train state, optimizer,
compiled step, no-grad value pass, checkpoints and export (docs/algorithms/ppo.md §3).

The critic is a :class:`Critic` module (a ``Transformer`` backbone, whose LM head it never uses,
and ``value_head``: d_model → 1 in fp32). It trains on the actor's packed batch (the same
``[R, M, T]`` rows, with the token fields ``value_old`` and ``return``) through the engine's
own ``TrainStep``, so its value loss is one global Σ/Σ like every jaxrl loss. V_old comes from
a ``Scorer`` whose per-row forward returns the critic's values: the train step's program
structure, as for GRPO's old log-probs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from flax import nnx

from jaxrl.config import ConfigError, PPOConfig, RunConfig
from jaxrl.losses.normalize import LossTerms
from jaxrl.losses.ppo import value_loss_terms
from jaxrl.models.hf import load_pretrained, save_pretrained
from jaxrl.models.lora import dense_config
from jaxrl.models.transformer import Transformer
from jaxrl.runtime import storage
from jaxrl.train.objectives import on_params
from jaxrl.train.optimizer import learning_rate_schedule, make_optimizer
from jaxrl.train.run_io.checkpoint import Checkpointer
from jaxrl.train.score import Scorer
from jaxrl.train.state import TrainState, create_state
from jaxrl.train.step import TrainStep

VALUE_OLD, RETURN = "value_old", "returns"  # the critic's token fields (target-aligned)
VALUE_HEAD_FILE = "value_head.npz"  # next to an exported critic's HF files: kernel, bias


class Critic(nnx.Module):
    """V(s_t) = h_t · w + b on the backbone's final-normed hidden state h_t, in fp32."""

    def __init__(self, backbone: Transformer, kernel: Any = None, bias: Any = None):
        self.backbone = backbone
        d = backbone.config.hidden_size
        self.value_kernel = nnx.Param(
            jnp.zeros((d, 1), jnp.float32) if kernel is None else jnp.asarray(kernel, jnp.float32)
        )
        self.value_bias = nnx.Param(
            jnp.zeros((1,), jnp.float32) if bias is None else jnp.asarray(bias, jnp.float32)
        )

    def values(self, mb: dict[str, jax.Array]) -> jax.Array:
        """``[B, T]`` fp32 values of the packed rows' positions (position j: the state after
        token j, i.e. the value of generating token j + 1: target-aligned)."""
        h_BTD = self.backbone.hidden_states(mb["tokens"], mb.get("positions"), mb["segment_ids"])
        return h_BTD.astype(jnp.float32) @ self.value_kernel[...][:, 0] + self.value_bias[...][0]


def critic_objective(config: PPOConfig) -> Any:
    """The critic's loss on a packed micro-batch: ``value_loss_terms`` of its values against the
    batch's ``value_old`` and ``return`` fields."""

    def objective(model: Critic, mb: dict[str, jax.Array]) -> LossTerms:
        return value_loss_terms(
            model.values(mb),
            mb[VALUE_OLD],
            mb[RETURN],
            mb["loss_mask"],
            mb["segment_ids"],
            clip_range_value=config.clip_range_value,
            vf_coef=config.vf_coef,
        )

    return objective


def _value_scores(model: Critic, mb: dict[str, jax.Array], **_: Any) -> tuple[Any, Any, Any]:
    """The Scorer's per-row forward for a critic: values in the ``logp`` slot."""
    v_BT = model.values(mb)
    return v_BT, jnp.zeros_like(v_BT), jnp.zeros(v_BT.shape, bool)


def critic_optimizer_config(cfg: RunConfig) -> Any:
    """The run's (stage) optimizer with ``ppo.critic_learning_rate`` when set."""
    lr = cfg.ppo.critic_learning_rate
    return cfg.optimizer if lr is None else dataclasses.replace(cfg.optimizer, learning_rate=lr)


@dataclasses.dataclass
class CriticRun:
    """The critic's state, compiled step, value pass and checkpointer."""

    graphdef: Any
    state: TrainState
    step_fn: TrainStep
    scorer: Scorer
    checkpointer: Checkpointer
    output_dir: epath.Path

    @classmethod
    def build(cls, cfg: RunConfig, session: Any, row_len: int) -> CriticRun:
        """A critic initialised from the policy as it is now (``session``'s parameters: the
        checkpoint the run started from), or from ``ppo.critic_path``."""
        mesh = session.mesh
        if cfg.ppo.critic_path is None:
            backbone = nnx.merge(session.graphdef, session.state.params)
            kernel = bias = None
        else:
            backbone, kernel, bias = read_critic(cfg.ppo.critic_path, session.model_config, mesh)
        graphdef, params = nnx.split(Critic(backbone, kernel, bias))
        opt = critic_optimizer_config(cfg)
        tx = make_optimizer(opt, cfg.max_steps)
        state, shardings = create_state(params, tx, cfg.seed, mesh)  # a copy: never aliased
        step = TrainStep(
            on_params(critic_objective(cfg.ppo), graphdef),
            tx,
            mesh,
            learning_rate=learning_rate_schedule(opt, cfg.max_steps),
            max_grad_norm=cfg.optimizer.max_grad_norm,
            docs_per_step=cfg.schedule.docs_per_step,
            state_shardings=shardings,
            master_rounding=cfg.optimizer.master_rounding,
        )
        scorer = Scorer(graphdef, mesh=mesh, row_len=row_len, row_scores=_value_scores)
        out = storage.path(cfg.output_dir)  # a local path or a URL
        keeper = Checkpointer(out / "critic" / "checkpoints", keep=cfg.checkpoint.keep)
        return cls(graphdef, state, step, scorer, keeper, out)

    def values(self, sequences: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Token-aligned values per document (value i: V before token i; 0 at 0)."""
        return self.scorer.token_logprobs(self.state.params, sequences)

    def train_on(self, arrays: dict[str, np.ndarray], rounds: int | None) -> dict[str, Any]:
        """One critic step on the actor's packed batch; its metrics (host floats)."""
        batch = self.step_fn.shard_batch(arrays)
        self.state, metrics = self.step_fn(self.state, batch, 0, rounds)
        return {k: np.asarray(v).item() for k, v in jax.device_get(metrics).items()}

    def save(self, step: int) -> None:
        self.checkpointer.save(step, self.state, {"step": step})

    def restore(self, step: int) -> None:
        """The critic saved with the policy's checkpoint ``step`` (a resumed run)."""
        if step not in self.checkpointer.steps():
            raise ConfigError(
                f"the policy resumes from step {step} but {self.checkpointer.directory} has no "
                "critic checkpoint for it: set checkpoint.resume=false to start fresh"
            )
        state, _ = self.checkpointer.restore(self.state, step)
        self.state = self.step_fn.place(state)

    def export(self, dtype: str) -> epath.Path:
        """``<output_dir>/critic/hf``: the backbone as an HF directory plus ``value_head.npz``
        (what ``ppo.critic_path`` reads)."""
        path = self.output_dir / "critic" / "hf"
        model = nnx.merge(self.graphdef, self.state.params)
        head = jax.device_get((model.value_kernel[...], model.value_bias[...]))
        with storage.staged(path) as local:  # a URL: written locally, then uploaded
            save_pretrained(model.backbone, local, dtype=dtype)
            if jax.process_index() == 0:
                np.savez(Path(local) / VALUE_HEAD_FILE, kernel=head[0], bias=head[1])
        return path

    def close(self) -> None:
        self.checkpointer.close()


def read_critic(path: str, config: Any, mesh: Any) -> tuple[Transformer, Any, Any]:
    """``ppo.critic_path``: an HF directory of the policy's architecture, with the value head of
    ``value_head.npz`` when present (zeros otherwise)."""
    try:
        backbone = load_pretrained(path, dense_config(config), mesh=mesh)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(
            f"ppo.critic_path={path!r} is invalid: {e}; name an HF directory with the policy's "
            "architecture (e.g. a jaxrl PPO run's <output_dir>/critic/hf)"
        ) from None
    head = Path(storage.local(path)) / VALUE_HEAD_FILE
    if not head.is_file():
        return backbone, None, None
    with np.load(head) as f:
        return backbone, f["kernel"], f["bias"]
