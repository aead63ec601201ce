"""``RunConfig``: a whole run, composed of the sections it uses, and the ``algorithm:`` names.

Every run has the run-level sections (``jaxrl.config.sections``: mesh, distributed, schedule,
optimizer, model, task / data, checkpoint, logging, export, rollout, warm_start) and the section
of its own algorithm (``STAGE_SECTIONS``): ``sft``, ``grpo``, ``dpo``, ``kto`` or ``ppo`` (PPO's
actor is ``ppo.actor``, a ``GRPOConfig``). A section of another algorithm is refused; the
``sft`` section is SFT's, and also the warm start's when a GRPO/PPO/DPO/KTO run has a
``warm_start``. Batch sizes are per data-parallel rank in every section (TRL's
``per_device_train_batch_size``), and the learning-rate schedule is ``optimizer``'s
(docs/config_reference.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from jaxrl.config.base import ConfigError, config_error, removed_fields, require, section
from jaxrl.config.dpo import DPOConfig
from jaxrl.config.grpo import GRPOConfig
from jaxrl.config.kto import KTOConfig
from jaxrl.config.ppo import PPOConfig
from jaxrl.config.sections.data import DataConfig, TaskConfig
from jaxrl.config.sections.mesh import DistributedConfig, MeshConfig
from jaxrl.config.sections.model import (
    MODEL_INIT_KEYS,
    MODEL_SECTION_KEYS,
    LoraSection,
    ModelSection,
)
from jaxrl.config.sections.optimizer import OptimizerConfig
from jaxrl.config.sections.outputs import CheckpointConfig, ExportConfig, LoggingConfig
from jaxrl.config.sections.rollout import RolloutConfig
from jaxrl.config.sections.schedule import ScheduleConfig
from jaxrl.config.sections.warm_start import WARM_START_FIXES, WarmStartConfig
from jaxrl.config.sft import SFTConfig

__all__ = [
    "ALGORITHMS",
    "CRITIC_ALGORITHMS",
    "MODEL_INIT_KEYS",
    "MODEL_SECTION_KEYS",
    "STAGE_SECTIONS",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "DistributedConfig",
    "ExportConfig",
    "LoggingConfig",
    "LoraSection",
    "MeshConfig",
    "ModelSection",
    "OptimizerConfig",
    "RolloutConfig",
    "RunConfig",
    "ScheduleConfig",
    "TaskConfig",
    "WarmStartConfig",
    "check_algorithm",
    "check_max_steps",
]

# Every ``algorithm:`` and the key of its own stage's section (its per-rank batch; PPO's actor
# is ppo.actor). The one list of names: ``jaxrl.trainers.registry`` maps each to its trainer
# (tests/test_algorithm.py keeps them in step).
STAGE_SECTIONS: dict[str, str] = {
    "sft": "sft",
    "grpo": "grpo",
    "dpo": "dpo",
    "kto": "kto",
    "ppo": "ppo.actor",
}
ALGORITHMS: tuple[str, ...] = tuple(STAGE_SECTIONS)
CRITIC_ALGORITHMS: tuple[str, ...] = ("ppo",)  # the algorithms that train a value model too
WARM_START_ALGORITHMS: tuple[str, ...] = ("grpo", "dpo", "kto", "ppo")  # may start with SFT
_SECTION_TYPES = {"sft": SFTConfig, "grpo": GRPOConfig, "dpo": DPOConfig, "kto": KTOConfig}
_SECTION_TYPES["ppo"] = PPOConfig


def check_algorithm(value: str) -> None:
    """``algorithm`` must be a known trainer."""
    if value not in ALGORITHMS:
        raise config_error("algorithm", value, f"use one of {', '.join(map(repr, ALGORITHMS))}")


def check_max_steps(value: int) -> None:
    """``max_steps`` must be positive."""
    if value < 1:
        raise config_error("max_steps", value, "use a positive number of optimizer steps")


def _new_section(name: str) -> Any:
    """Algorithm section ``name`` with its defaults, its world size unknown (the mesh sets it)."""
    if name == "ppo":
        return PPOConfig()
    return _SECTION_TYPES[name](world_size=None)


@removed_fields(**WARM_START_FIXES)
@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    """A whole run, as ``jaxrl train CONFIG.yaml`` reads it."""

    algorithm: Literal[ALGORITHMS] = "sft"  # which trainer runs
    output_dir: str = "runs/default"  # metrics.jsonl, checkpoints and plots go here
    seed: int = 0  # seeds data order, initialisation and sampling
    max_steps: int = 100  # optimizer steps
    compile_cache: bool | str = True  # JAX's persistent compilation cache: true = the user
    # cache directory (~/.cache/jaxrl/xla; $JAXRL_COMPILE_CACHE overrides), a path, or false
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
    schedule: ScheduleConfig = dataclasses.field(default_factory=ScheduleConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    task: TaskConfig | None = None  # the built-in task; None = the default task (filled in by
    # resolved()), unless data
    data: DataConfig = dataclasses.field(default_factory=DataConfig)  # real data (or `task`)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    export: ExportConfig = dataclasses.field(default_factory=ExportConfig)
    warm_start: WarmStartConfig | None = None  # grpo, ppo, dpo, kto: SFT steps first (the
    # sft section) into output_dir/sft; None = no warm start
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)  # GRPO/PPO
    # generation
    sft: SFTConfig | None = None  # algorithm: sft, and the warm start's SFT; None = defaults
    # when used
    grpo: GRPOConfig | None = None  # algorithm: grpo only
    dpo: DPOConfig | None = None  # algorithm: dpo only
    kto: KTOConfig | None = None  # algorithm: kto only
    ppo: PPOConfig | None = None  # algorithm: ppo only: the actor (ppo.actor), critic and GAE

    def __post_init__(self):
        check_algorithm(self.algorithm)
        check_max_steps(self.max_steps)
        self._compose_sections()
        self._check_data_source()
        self._check_precision()
        self._check_decode_layout()
        require(
            0 <= self.seed < 2**32,
            "seed",
            self.seed,
            "use an integer in [0, 2**32) (it seeds numpy and jax)",
        )
        require(
            not isinstance(self.compile_cache, str) or bool(self.compile_cache.strip()),
            "compile_cache",
            self.compile_cache,
            "use true (the user cache directory), false (off) or a directory path",
        )
        require(
            bool(self.output_dir.strip()),
            "output_dir",
            self.output_dir,
            "name a directory for metrics, checkpoints and exports, e.g. runs/my_run",
        )
        if self.sft is not None and self.sft.max_length > self.schedule.max_tokens:
            raise ConfigError(
                f"sft.max_length={self.sft.max_length} exceeds schedule.max_tokens="
                f"{self.schedule.max_tokens}: a document must fit in one micro-batch row; raise "
                "schedule.max_tokens or lower sft.max_length"
            )

    def _compose_sections(self) -> None:
        """The sections the run uses, and no others: the algorithm's own (its defaults when not
        given) and, with a warm start, ``sft``; a section of another algorithm, or a warm start
        of SFT itself, is a ``ConfigError`` naming the key and where it belongs."""
        used = {"sft"} if self.algorithm == "sft" or self.warm_start is not None else set()
        used.add(self.algorithm)
        for name in _SECTION_TYPES:
            if name in used or getattr(self, name) is None:
                continue
            if name == "grpo" and self.algorithm == "ppo":
                fix = "PPO's rollouts and actor are the ppo.actor section: move the grpo keys there"
            elif name == "sft":
                fix = (
                    "the sft section is algorithm: sft's, or a warm start's: add a warm_start "
                    "section (warm_start.steps > 0) or remove the sft section (--set sft=null)"
                )
            else:
                fix = (
                    f"it is the section of algorithm: {name}; remove it (--set {name}=null) or "
                    f"set algorithm: {name}"
                )
            raise ConfigError(f"{name} is invalid with algorithm: {self.algorithm}: {fix}")
        if self.warm_start is not None and self.algorithm not in WARM_START_ALGORITHMS:
            raise ConfigError(
                f"warm_start is invalid with algorithm: {self.algorithm}: a warm start is the SFT "
                f"stage before {', '.join(WARM_START_ALGORITHMS)}; remove the warm_start section"
            )
        for name in used:
            if getattr(self, name) is None:  # a used section not given: its defaults
                object.__setattr__(self, name, _new_section(name))

    @property
    def stage(self) -> SFTConfig | GRPOConfig | DPOConfig | KTOConfig:
        """The section of the algorithm's own stage (``STAGE_SECTIONS``; PPO: ``ppo.actor``):
        its per-rank batch, and for the GRPO family its rollouts."""
        if self.algorithm == "ppo":
            return self.ppo.actor
        return getattr(self, self.algorithm)

    @property
    def samples_rollouts(self) -> bool:
        """GRPO's family (GRPO, PPO): the run samples rollouts (the stage and rollout sections)."""
        return isinstance(self.stage, GRPOConfig)

    @property
    def trains_critic(self) -> bool:
        """PPO: a value model is trained beside the policy (docs/algorithms/ppo.md)."""
        return self.algorithm in CRITIC_ALGORITHMS

    @property
    def warm_starts(self) -> bool:
        """The run starts with SFT steps (``warm_start.steps > 0``)."""
        return self.warm_start is not None and self.warm_start.enabled

    @property
    def batch_ranks_known(self) -> bool:
        """Every batch section knows its world size (a fixed mesh, or ``with_batch_ranks``)."""
        return all(s.world_size is not None for s in self._batch_sections().values())

    def resolved(self) -> RunConfig:
        """The one resolve step (``load_run_config`` runs it; nothing else fills a config in):
        a new config with the built-in task's defaults when neither ``task`` nor
        ``data.train`` is given, and the batch sections at the mesh's data-parallel ranks
        when the mesh fixes them (a -1 axis leaves them to the run: ``with_batch_ranks``). A
        config never changes itself."""
        changes: dict[str, Any] = {}
        if self.data.train is None and self.task is None:
            changes["task"] = TaskConfig()
        ranks = self.mesh.static_batch_ranks
        if ranks is not None:
            changes.update(self._sections_at(ranks))
        return dataclasses.replace(self, **changes) if changes else self

    def with_batch_ranks(self, ranks: int) -> RunConfig:
        """This config with its batch sections resolved for ``ranks`` data-parallel ranks: what
        a run does at start when a mesh axis is -1 (``ranks`` from its devices). Raises the
        sections' ``ConfigError`` when their batches do not fit ``ranks``."""
        changed = self._sections_at(ranks)
        return dataclasses.replace(self, **changed) if changed else self

    def _batch_sections(self) -> dict[str, Any]:
        """``{key: section}`` of the sections present whose batch is per rank."""
        out = {name: getattr(self, name) for name in ("sft", "grpo", "dpo", "kto")}
        if self.ppo is not None:
            out["ppo.actor"] = self.ppo.actor
        return {k: v for k, v in out.items() if v is not None}

    def _sections_at(self, ranks: int) -> dict[str, Any]:
        """The batch sections whose world size is not yet ``ranks``, resolved for it."""
        out: dict[str, Any] = {}
        for key, sec in self._batch_sections().items():
            if sec.world_size == ranks:
                continue
            with section(key):
                if isinstance(sec, GRPOConfig):
                    sec = sec.for_world_size(ranks)
                else:
                    sec = dataclasses.replace(sec, world_size=ranks)
            if key == "ppo.actor":
                out["ppo"] = dataclasses.replace(self.ppo, actor=sec)
            else:
                out[key] = sec
        return out

    def _check_decode_layout(self) -> None:
        """``rollout.tensor_parallel`` divides the generation devices, checked when the config
        fixes their count (the whole mesh when synchronous; ``rollout.devices`` when set for a
        run that generates ahead), so a bad value stops the run before any stage, not after an
        SFT warm start. Otherwise the sampler's construction checks it."""
        t = self.rollout.tensor_parallel
        if not self.samples_rollouts or t <= 1 or -1 in self.mesh.sizes:
            return
        devices = self.mesh.fixed_devices
        if self.rollout.max_staleness:
            if not self.rollout.devices:
                return  # half of the devices, counted at start
            devices = self.rollout.devices
        require(
            devices % t == 0,
            "rollout.tensor_parallel",
            t,
            f"use a divisor of the {devices} generation devices, or 0 (auto)",
        )

    def _check_precision(self) -> None:
        """A bf16 master keeps AdamW's updates only with an explicit rounding choice; the
        choice means nothing for an fp32 master."""
        rounding = self.optimizer.master_rounding
        if self.model.param_dtype != "float32" and rounding is None:
            raise ConfigError(
                f"model.param_dtype={self.model.param_dtype!r} stores the master weights in "
                "bf16, where AdamW updates smaller than half a bf16 ulp (most updates at "
                "learning rates below ~1e-4) round away. Use model.param_dtype=float32 with "
                "model.dtype=bfloat16 (fp32 master, bf16 compute), or opt in with "
                "optimizer.master_rounding=stochastic (unbiased) or =nearest (updates lost, "
                "warned)"
            )
        if self.model.param_dtype == "float32" and rounding is not None:
            raise ConfigError(
                f"optimizer.master_rounding={rounding!r} is invalid with "
                "model.param_dtype='float32': an fp32 master keeps every update; remove "
                "optimizer.master_rounding (it applies to a bfloat16 master only)"
            )

    def _check_data_source(self) -> None:
        """``task`` and ``data.train`` are alternatives: the built-in task is the default (no
        ``data.train``), and giving both is an error (``resolved`` fills the default task in).
        Real data needs ``model.path`` (the tokenizer and chat template come from it)."""
        if self.data.train is None:
            return
        if self.task is not None:
            raise ConfigError(
                f"task and data.train={self.data.train!r} are both given: a run trains on the "
                "built-in task or on real data, not both; remove the task section (or data.train)"
            )
        if self.model.path is None:
            raise ConfigError(
                f"model.path is required with data.train={self.data.train!r}: the tokenizer and "
                "chat template come from the model directory; set model.path to a local HF "
                "model directory"
            )
        if self.warm_starts:
            raise ConfigError(
                f"warm_start.steps={self.warm_start.steps} is invalid with data.train: the warm "
                f"start trains on the built-in task, and data.train holds {self.algorithm} rows; "
                "run SFT on your SFT data first and point model.path at its export "
                "(<output_dir>/hf), without a warm_start section"
            )
