"""Run-level config sections shared by every trainer, and the top-level ``RunConfig``."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from typing import Any, Literal

from jaxrl.config.base import ConfigError, config_error, require, require_choice, section, suggest
from jaxrl.config.dpo import DPOConfig
from jaxrl.config.grpo import GRPOConfig
from jaxrl.config.kto import KTOConfig
from jaxrl.config.ppo import PPOConfig
from jaxrl.config.sft import SFTConfig
from jaxrl.config.vllm import VLLMConfig
from jaxrl.models.model_config import (
    ALL_LINEAR,
    ATTENTION_IMPLS,
    LORA_TARGETS,
    QUANTIZE_MODES,
    LoraSpec,
    ModelConfig,
)

MAX_MESH_DEVICES = 1 << 20  # no machine has more; a larger product is a typo
MODEL_SECTION_KEYS = (
    "param_dtype",
    "dtype",
    "matmul_dtype",
    "fp32_lm_head",
    "attention_impl",
    "attention_block_size",
    "scan_layers",
    "remat",
    "lora",
)
# ``model.init`` keys: ModelConfig's architecture fields (the rest are model.<key> settings)
MODEL_INIT_KEYS = tuple(
    f.name for f in dataclasses.fields(ModelConfig) if f.name not in MODEL_SECTION_KEYS
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """Device mesh ``data × fsdp × tensor``; the product must equal the device count (one axis
    may be -1 = the rest). Batches are split over data × fsdp (the data-parallel ranks);
    parameters and optimizer moments are sharded over fsdp and tensor (docs/scale_out.md)."""

    data: int = -1  # data-parallel ranks (parameters replicated); -1 = the remaining devices
    fsdp: int = 1  # fully sharded data parallel: parameters split, batch split too
    tensor: int = 1  # tensor parallel: heads / MLP / vocabulary split, batch replicated
    expert: int = 1  # expert parallel (MoE models): experts split, batch replicated; no -1
    slices: int = 1  # TPU slices (multislice): only the data axis crosses them (the DCN)

    def __post_init__(self):
        require(
            isinstance(self.slices, int) and not isinstance(self.slices, bool) and self.slices >= 1,
            "mesh.slices",
            self.slices,
            "use the number of TPU slices (1: one slice); the data axis is laid across them",
        )
        require(
            self.data == -1 or self.data % self.slices == 0,
            "mesh.data",
            self.data,
            f"with mesh.slices={self.slices} the data axis crosses the slices, so it must be a "
            f"multiple of {self.slices}",
        )
        require(
            isinstance(self.expert, int) and not isinstance(self.expert, bool) and self.expert >= 1,
            "mesh.expert",
            self.expert,
            "use a positive size (1: no expert axis); it must divide model.num_experts",
        )
        for name in ("data", "fsdp", "tensor"):
            size = getattr(self, name)
            require(
                isinstance(size, int) and (size >= 1 or size == -1),
                f"mesh.{name}",
                size,
                "use a positive size, or -1 for the remaining devices",
            )
        rest = [name for name in ("data", "fsdp", "tensor") if getattr(self, name) == -1]
        require(
            len(rest) <= 1,
            f"mesh.{rest[-1] if rest else 'data'}",
            -1,
            f"only one axis may be -1 (the rest); {', '.join('mesh.' + n for n in rest)} all are",
        )
        product = abs(self.data * self.fsdp * self.tensor * self.expert)
        require(
            product <= MAX_MESH_DEVICES,
            "mesh",
            f"data={self.data} x fsdp={self.fsdp} x tensor={self.tensor}",
            f"{product} devices is more than any machine has (at most {MAX_MESH_DEVICES}); "
            "size the mesh to your devices",
        )

    @property
    def fixed_devices(self) -> int:
        """Devices the axes other than a -1 axis use (the whole count when none is -1)."""
        product = self.data * self.fsdp * self.tensor * self.expert
        return product * (-1 if -1 in self.sizes else 1)

    @property
    def sizes(self) -> tuple[int, int, int]:
        return self.data, self.fsdp, self.tensor

    @property
    def static_batch_ranks(self) -> int | None:
        """Data-parallel ranks ``data × fsdp``; None when an axis is -1 (the run resolves it
        against its devices at start)."""
        return None if -1 in self.sizes else self.data * self.fsdp


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistributedConfig:
    """Multi-process launch (TPU pods, GPU clusters): the arguments of
    ``jax.distributed.initialize``. Every host runs the same ``jaxrl train CONFIG``."""

    coordinator_address: str | None = None  # "host:port" of process 0, reachable by every host
    num_processes: int | None = None  # processes in the job (hosts × processes per host)
    process_id: int | None = None  # this process: 0 .. num_processes - 1
    auto: bool = False  # let JAX detect the cluster (TPU pod, SLURM, Kubernetes, ...)

    def __post_init__(self):
        explicit = {
            "coordinator_address": self.coordinator_address,
            "num_processes": self.num_processes,
            "process_id": self.process_id,
        }
        given = [k for k, v in explicit.items() if v is not None]
        if given and not self.auto and len(given) < 3:
            missing = [k for k in explicit if k not in given]
            raise ConfigError(
                f"distributed.{missing[0]} is missing: with distributed.{given[0]} set, give "
                "coordinator_address, num_processes and process_id (or distributed.auto: true "
                "to let JAX detect them)"
            )
        if self.num_processes is not None:
            require(
                self.num_processes >= 1,
                "distributed.num_processes",
                self.num_processes,
                "use the number of processes in the job (>= 1)",
            )
        if self.process_id is not None:
            bound = self.num_processes
            require(
                self.process_id >= 0 and (bound is None or self.process_id < bound),
                "distributed.process_id",
                self.process_id,
                f"use 0 .. num_processes - 1 ({bound})" if bound else "use an id >= 0",
            )
        if self.coordinator_address is not None:
            require(
                ":" in self.coordinator_address,
                "distributed.coordinator_address",
                self.coordinator_address,
                'use "host:port" of process 0, e.g. "10.0.0.1:1234"',
            )

    @property
    def enabled(self) -> bool:
        return self.auto or self.coordinator_address is not None


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScheduleConfig:
    """How an optimizer step's documents become device micro-batches."""

    max_tokens: int = 512  # token budget of one micro-batch row (T)
    docs_per_step: int = 0  # global document target per step; 0 = off (static steps)
    packing: Literal["ffd", "first_fit"] = "ffd"  # bin packing of documents into rows
    balance: Literal["cost", "strided", "kk"] = "cost"  # distribution of rows over ranks
    micro_batch_buckets: tuple[int, ...] = ()  # per-rank micro-batch slots M a step may use
    # (one compiled program each; the smallest that holds the step); () = powers of two

    def __post_init__(self):
        require(
            self.max_tokens >= 1,
            "schedule.max_tokens",
            self.max_tokens,
            "use a positive token budget per micro-batch",
        )
        require(
            self.docs_per_step >= 0,
            "schedule.docs_per_step",
            self.docs_per_step,
            "use 0 to turn document-count accumulation off, or a positive target",
        )
        require(
            all(k >= 1 for k in self.micro_batch_buckets),
            "schedule.micro_batch_buckets",
            self.micro_batch_buckets,
            "use positive bucket sizes",
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """AdamW with warmup and decay, global-norm clipping; moments are always fp32."""

    learning_rate: float = 1e-3  # peak learning rate
    warmup_steps: int = 0  # linear warmup from 0 to the peak
    decay: Literal["cosine", "linear", "constant"] = "cosine"  # shape after warmup
    min_lr_ratio: float = 0.1  # final learning rate as a fraction of the peak
    weight_decay: float = 0.0  # decoupled weight decay
    b1: float = 0.9  # Adam first-moment decay
    b2: float = 0.95  # Adam second-moment decay. TRL's (transformers') default is 0.999;
    # 0.95 (Llama's, GPT-3's) averages over ~20 steps, not ~1000, so the step size follows the
    # gradient scale within runs of a few hundred steps (the shipped tiny configs, whose metrics
    # depend on it); the real-model configs set 0.999
    eps: float = 1e-8  # Adam epsilon
    max_grad_norm: float = 1.0  # global-norm clip; 0 = off
    max_nonfinite_steps: int = 3  # stop after this many non-finite steps in a row (skipped)
    master_rounding: Literal["stochastic", "nearest"] | None = None  # bf16 master only:
    # "stochastic" (unbiased, keeps updates in expectation) or "nearest" (updates under half a
    # bf16 ulp are lost; warned at start-up); an fp32 master needs none (docs/precision.md)

    def __post_init__(self):
        require(
            self.learning_rate > 0,
            "optimizer.learning_rate",
            self.learning_rate,
            "use a positive learning rate",
        )
        require(self.warmup_steps >= 0, "optimizer.warmup_steps", self.warmup_steps, "use >= 0")
        require(
            0 <= self.min_lr_ratio <= 1,
            "optimizer.min_lr_ratio",
            self.min_lr_ratio,
            "use a value in [0, 1]",
        )
        require(0 <= self.b1 < 1, "optimizer.b1", self.b1, "use a value in [0, 1)")
        require(0 <= self.b2 < 1, "optimizer.b2", self.b2, "use a value in [0, 1)")
        require(
            self.max_grad_norm >= 0,
            "optimizer.max_grad_norm",
            self.max_grad_norm,
            "use 0 to turn clipping off, or a positive norm",
        )
        require(self.weight_decay >= 0, "optimizer.weight_decay", self.weight_decay, "use >= 0")
        require(self.eps > 0, "optimizer.eps", self.eps, "use a small positive number, e.g. 1e-8")
        require(
            self.max_nonfinite_steps >= 1,
            "optimizer.max_nonfinite_steps",
            self.max_nonfinite_steps,
            "use >= 1 (a non-finite step is skipped; this many in a row stop the run)",
        )


AttentionImpl = Literal[ATTENTION_IMPLS]  # docs/attention.md


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraSection:
    """Low-rank adapters (LoRA / rsLoRA / QLoRA, docs/lora.md): only the adapters are trained,
    optimised and checkpointed; the base is frozen in the compute dtype (quantised with
    ``quantize``) and is the reference of DPO / GRPO with beta > 0. ``rank: 0`` = off."""

    rank: int = 0  # adapter rank r; 0 = full fine-tuning (no adapters)
    alpha: float = 16.0  # adapter output scaled by alpha / rank (alpha / sqrt(rank) with rsLoRA)
    dropout: float = 0.0  # PEFT's lora_dropout; only 0.0 (a random mask per micro-batch
    # would make the update depend on the micro-batching)
    target_modules: str | list[str] = ALL_LINEAR  # "all-linear" or HF projection names:
    # q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj
    use_rslora: bool = False  # rank-stabilised scaling alpha / sqrt(rank)
    quantize: Literal[QUANTIZE_MODES] = "none"  # frozen base projections: none, int8 or nf4
    # (QLoRA); needs rank > 0
    adapter_path: str | None = None  # a PEFT adapter directory (adapter_config.json +
    # adapter_model.safetensors) whose weights start the adapters; its rank and targets are used

    def __post_init__(self):
        require(
            isinstance(self.rank, int) and self.rank >= 0,
            "model.lora.rank",
            self.rank,
            "use 0 (no adapters) or a positive rank such as 8 or 16",
        )
        require(self.alpha > 0, "model.lora.alpha", self.alpha, "use a positive alpha, e.g. 16")
        require(
            self.dropout == 0.0,
            "model.lora.dropout",
            self.dropout,
            "only 0.0 is supported: a dropout mask drawn per micro-batch would make the update "
            "depend on how the batch is cut into micro-batches; leave it at 0",
        )
        targets = self.targets
        unknown = [t for t in targets if t not in LORA_TARGETS]
        require(
            bool(targets) and not unknown,
            "model.lora.target_modules",
            self.target_modules,
            f"use {ALL_LINEAR!r} or a list of {', '.join(LORA_TARGETS)}",
        )
        require(
            self.quantize == "none" or self.rank > 0 or self.adapter_path is not None,
            "model.lora.quantize",
            self.quantize,
            "a quantised base is frozen, so it needs adapters to train: set model.lora.rank",
        )

    @property
    def enabled(self) -> bool:
        """Whether the run trains adapters (a rank or an adapter directory is given)."""
        return self.rank > 0 or self.adapter_path is not None

    @property
    def targets(self) -> tuple[str, ...]:
        """The targeted projections' HF names (``all-linear``: all seven)."""
        if isinstance(self.target_modules, str):
            return LORA_TARGETS if self.target_modules == ALL_LINEAR else (self.target_modules,)
        return tuple(self.target_modules)

    def spec(self) -> LoraSpec | None:
        """The model's ``LoraSpec`` (None without a rank; an ``adapter_path``'s rank and
        targets are read when the model is built)."""
        if self.rank == 0:
            return None
        return LoraSpec(
            rank=self.rank,
            alpha=float(self.alpha),
            target_modules=self.targets,
            use_rslora=self.use_rslora,
            quantize=self.quantize,
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSection:
    """Which model to train: a local HF directory, or a fresh model of the given shape."""

    path: str | None = None  # local HF checkpoint directory; None = initialise from `init`
    init: dict[str, Any] = dataclasses.field(default_factory=dict)  # ModelConfig.tiny overrides
    param_dtype: Literal["float32", "bfloat16"] = "float32"  # master weights: what AdamW
    # updates and checkpoints store; bfloat16 needs optimizer.master_rounding (docs/precision.md)
    dtype: Literal["float32", "bfloat16", "auto"] | None = None  # compute dtype of the forward,
    # the sampler and the scorer; None = param_dtype; auto = the backend's fast dtype: bfloat16
    # on GPU/TPU, float32 where bf16 arithmetic is emulated (CPU) (docs/precision.md)
    matmul_dtype: Literal["float32", "bfloat16", "auto"] | None = None  # operands of the
    # projection matmuls (fp32 accumulation); None = the compute dtype, or auto when dtype is
    # auto; auto = bfloat16 under fp32 compute on a CPU with AMX-BF16 or AVX512-BF16
    # (docs/precision.md)
    fp32_lm_head: bool = False  # logits in fp32 from (possibly bf16) hidden and weights
    logprob_chunk: int = 0  # token chunk for log-probs (0 = auto: whole rows unless a chunk's
    # logits would exceed 128M values, as with a 150k vocabulary on rows over 512 tokens)
    attention_impl: AttentionImpl = "auto"  # attention kernel; auto = best for the backend
    attention_block_size: int = 128  # query/key block of flash and the Pallas kernels
    scan_layers: bool = False  # stack the layers' parameters and run them with one lax.scan
    remat: str = "none"  # recompute in backward: "none", "block" or a jax.checkpoint_policies name
    lora: LoraSection = dataclasses.field(default_factory=LoraSection)  # adapters (docs/lora.md)

    def __post_init__(self):
        for key in self.init:
            if key in MODEL_SECTION_KEYS:
                raise ConfigError(
                    f"model.init.{key} is set by model.{key}: move it out of model.init"
                )
            if key not in MODEL_INIT_KEYS:
                raise ConfigError(
                    f"unknown config key 'model.init.{key}': {suggest(str(key), MODEL_INIT_KEYS)}"
                )
        require(
            self.attention_block_size >= 1,
            "model.attention_block_size",
            self.attention_block_size,
            "use a positive block size (tokens), e.g. 128",
        )
        require(
            self.logprob_chunk >= 0,
            "model.logprob_chunk",
            self.logprob_chunk,
            "use 0 (no chunking) or a positive chunk size",
        )
        if self.remat not in ("none", "block"):  # a policy name: checked against jax's list
            from jaxrl.models.layer_stack import check_remat

            try:
                check_remat(self.remat, "model.remat")
            except ValueError as e:
                raise ConfigError(str(e)) from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class TaskConfig:
    """A built-in synthetic task (no download)."""

    name: Literal["arithmetic", "calculator"] = "arithmetic"  # arithmetic: a<op>b= answered
    # directly; calculator: answered with a calc tool call (GRPO with grpo.tools, docs/tools.md)
    min_digits: int = 1  # smallest operand width
    max_digits: int = 2  # largest operand width
    ops: str = "+"  # operators to draw from
    reverse_answer: bool = True  # answers least-significant digit first (easier to learn)
    pad_operands: bool = True  # zero-pad operands to max_digits (fixed digit positions)
    train_size: int = 4000  # distinct training problems
    eval_size: int = 200  # distinct held-out problems
    tool_transcripts: float = 0.5  # calculator: fraction of SFT transcripts that call the tool

    def __post_init__(self):
        require(
            1 <= self.min_digits <= self.max_digits,
            "task.min_digits",
            self.min_digits,
            f"use 1 <= min_digits <= max_digits ({self.max_digits})",
        )
        require(self.train_size >= 1, "task.train_size", self.train_size, "use >= 1")
        require(self.eval_size >= 1, "task.eval_size", self.eval_size, "use >= 1")
        t = self.tool_transcripts
        require(0 <= t <= 1, "task.tool_transcripts", t, "use a fraction in [0, 1]")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Real data in TRL's formats (docs/data.md); the alternative to the built-in ``task``.

    Each of ``train``/``eval`` is a local ``.jsonl``/``.json``/``.parquet`` file, a directory
    written by ``datasets``' ``save_to_disk``, or (not a local path) a ``datasets.load_dataset``
    name. The tokenizer (and chat template) comes from ``model.path``.
    """

    train: str | None = None  # training data; None = the built-in task
    eval: str | None = None  # held-out data for eval metrics; None = no evaluation
    split: str = "train"  # split of data.train when it is a DatasetDict directory or a hub name
    eval_split: str = "test"  # split of data.eval when it is a DatasetDict directory or a name

    def __post_init__(self):
        for name in ("train", "eval", "split", "eval_split"):
            value = getattr(self, name)
            require(
                value is None or bool(value.strip()),
                f"data.{name}",
                value,
                "name a file, a save_to_disk directory or a dataset (or leave it out)",
            )
        if self.eval is not None and self.train is None:
            raise ConfigError(
                f"data.eval={self.eval!r} is invalid without data.train: held-out data "
                "evaluates a run on real data; set data.train too (or drop data.eval)"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Orbax checkpoints under ``<output_dir>/checkpoints``."""

    every: int = 0  # save every N steps; 0 = only at the end
    keep: int = 2  # keep the newest N checkpoints
    resume: bool = True  # continue from the newest checkpoint in output_dir if there is one

    def __post_init__(self):
        require(self.every >= 0, "checkpoint.every", self.every, "use 0 (end only) or N > 0")
        require(self.keep >= 1, "checkpoint.keep", self.keep, "keep at least one checkpoint")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExportConfig:
    """The HF export ``<output_dir>/hf`` written at the end of a run (docs/precision.md)."""

    dtype: Literal["float32", "bfloat16"] | None = None  # exported weights' dtype; None = the
    # model.path checkpoint's own (config.json torch_dtype), or model.param_dtype when fresh


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """GRPO generation: where and when rollouts are produced (docs/algorithms/async.md)."""

    max_staleness: int = 0  # policy versions a trained batch may lag its generating weights;
    # 0 = generate, then train (synchronous); k >= 1 = generate ahead while the trainer trains
    devices: int = 0  # devices reserved for generation when max_staleness >= 1 (the last ones);
    # 0 = half of them (none with one device: generation then shares it)
    max_slots: int = 0  # decode slots of the rollout engine (docs/rollout.md): a stopped
    # completion's slot takes the next waiting one; 0 = one slot per completion of the batch
    compact_slots: bool = True  # once every completion has a slot and the live ones fit a half
    # (then a quarter) of the slots, decode on in that many (docs/rollout.md); false = every
    # step runs every slot (shorter compiles)
    tensor_parallel: int = 0  # the sampler's decode layout (docs/scale_out.md): groups of this
    # many devices decode tensor-parallel, the groups data-parallel; 1 = a whole compute-dtype
    # copy per device; 0 = auto: the fewest devices whose share fits weight_budget_gb
    weight_budget_gb: float = 20.0  # auto tensor_parallel: the sampler's weights per device
    scan_layers: bool = False  # with model.scan_layers: the engine decodes in the layer scan
    # (shorter compiles, slower steps); false = unrolled, each layer its own weights
    # (docs/rollout.md)
    backend: Literal["engine", "vllm"] = "engine"  # who generates: jaxrl's engine, or vLLM
    # servers (rollout.vllm; docs/rollout.md)
    sync_every: int = 1  # vllm: send the weights to the servers every k optimizer steps (the
    # samples carry the version they were made with)
    vllm: VLLMConfig = dataclasses.field(default_factory=VLLMConfig)  # backend: vllm's servers

    def __post_init__(self):
        require(
            isinstance(self.sync_every, int) and self.sync_every >= 1,
            "rollout.sync_every",
            self.sync_every,
            "use 1 (every step) or k >= 1 optimizer steps between weight syncs",
        )
        require(
            isinstance(self.max_staleness, int) and self.max_staleness >= 0,
            "rollout.max_staleness",
            self.max_staleness,
            "use 0 (synchronous) or k >= 1 policy versions of lag",
        )
        require(
            isinstance(self.devices, int) and self.devices >= 0,
            "rollout.devices",
            self.devices,
            "use 0 (half of the devices) or the number of devices to generate on",
        )
        require(
            isinstance(self.max_slots, int) and self.max_slots >= 0,
            "rollout.max_slots",
            self.max_slots,
            "use 0 (one slot per completion) or the number of decode slots, e.g. 64",
        )
        require(
            isinstance(self.tensor_parallel, int) and self.tensor_parallel >= 0,
            "rollout.tensor_parallel",
            self.tensor_parallel,
            "use 0 (auto), 1 (a whole copy per device) or a divisor of the generation devices",
        )
        require(
            isinstance(self.compact_slots, bool),
            "rollout.compact_slots",
            self.compact_slots,
            "use true (steps run only the live slots) or false (every slot, shorter compiles)",
        )
        require(
            isinstance(self.scan_layers, bool),
            "rollout.scan_layers",
            self.scan_layers,
            "use false (unrolled: faster decode) or true (one scanned layer: shorter compiles)",
        )
        require(
            isinstance(self.weight_budget_gb, int | float) and self.weight_budget_gb > 0,
            "rollout.weight_budget_gb",
            self.weight_budget_gb,
            "use a positive number of GB, e.g. 20",
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    """Console and file logging: metrics.jsonl, TensorBoard, W&B (docs/logging.md)."""

    progress: bool = True  # show a rich progress bar
    eval_every: int = 0  # evaluate every N steps; 0 = only at the end
    eval_samples: int = 8  # GRPO: samples per held-out prompt for eval/accuracy_sampled; 0 = off
    tensorboard: bool = True  # mirror metrics.jsonl as event files in <output_dir>/tensorboard/
    wandb: str | None = None  # Weights & Biases project to log the same rows to; None = off

    def __post_init__(self):
        if self.wandb is not None:
            require(
                bool(self.wandb.strip()),
                "logging.wandb",
                self.wandb,
                "name a W&B project, or leave it out (None) to not use W&B",
            )
            if not _importable("wandb"):
                raise ConfigError(
                    f"logging.wandb={self.wandb!r} needs the wandb package: pip install wandb "
                    "(or leave logging.wandb out)"
                )
        require(self.eval_every >= 0, "logging.eval_every", self.eval_every, "use >= 0")
        require(
            self.eval_samples >= 0,
            "logging.eval_samples",
            self.eval_samples,
            "use 0 (greedy eval/accuracy only) or k > 0 samples per held-out prompt",
        )


def _importable(module: str) -> bool:
    """``import module`` would work (a module injected into ``sys.modules`` counts)."""
    if module in sys.modules:
        return sys.modules[module] is not None
    return importlib.util.find_spec(module) is not None


def check_max_steps(value: int) -> None:
    """``max_steps`` must be positive."""
    if value < 1:
        raise config_error("max_steps", value, "use a positive number of optimizer steps")


# Every ``algorithm:`` and the section of its own stage: its per-rank batch and learning rate
# (PPO's actor is the grpo section; SFT's batch is global). The one list of names:
# ``jaxrl.trainers.registry`` maps each to its trainer (tests/test_algorithm.py keeps them in step).
STAGE_SECTIONS: dict[str, str | None] = {
    "sft": None,
    "grpo": "grpo",
    "dpo": "dpo",
    "kto": "kto",
    "ppo": "grpo",
}
ALGORITHMS: tuple[str, ...] = tuple(STAGE_SECTIONS)
CRITIC_ALGORITHMS: tuple[str, ...] = ("ppo",)  # the algorithms that train a value model too


def check_algorithm(value: str) -> None:
    """``algorithm`` must be a known trainer."""
    require_choice("algorithm", value, ALGORITHMS)


__all__ = [
    "CheckpointConfig",
    "DataConfig",
    "DistributedConfig",
    "ExportConfig",
    "RunConfig",
    "ConfigError",
    "LoggingConfig",
    "MeshConfig",
    "ModelSection",
    "OptimizerConfig",
    "RolloutConfig",
    "ScheduleConfig",
    "TaskConfig",
    "ALGORITHMS",
    "STAGE_SECTIONS",
    "check_algorithm",
    "check_max_steps",
]


def _algorithm_section(cls: type) -> Any:
    """A RunConfig field holding an algorithm section, by default with its world size unknown
    (None: the mesh sets it)."""
    return dataclasses.field(default_factory=lambda: cls(world_size=None))


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
    sft: SFTConfig = dataclasses.field(default_factory=SFTConfig)
    sft_warmup_steps: int = 0  # grpo/dpo: first run this many SFT steps (output_dir/sft)
    sft_warmup_target: float = 0.0  # stop the warm start once held-out accuracy >= this; 0 = off
    sft_warmup_eval_every: int = 10  # with a target: SFT steps between held-out checks
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)  # GRPO generation
    grpo: GRPOConfig = _algorithm_section(GRPOConfig)  # world_size: the mesh's data × fsdp
    dpo: DPOConfig = _algorithm_section(DPOConfig)  # world_size: the mesh's data × fsdp
    kto: KTOConfig = _algorithm_section(KTOConfig)  # world_size: the mesh's data × fsdp
    ppo: PPOConfig = dataclasses.field(default_factory=PPOConfig)  # algorithm: ppo's critic
    # and GAE; its rollout and actor settings are the grpo section's

    def __post_init__(self):
        check_algorithm(self.algorithm)
        check_max_steps(self.max_steps)
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
        require(
            self.sft_warmup_steps >= 0,
            "sft_warmup_steps",
            self.sft_warmup_steps,
            "use 0 (start from model.path or scratch) or a positive number of SFT steps",
        )
        require(
            0.0 <= self.sft_warmup_target <= 1.0,
            "sft_warmup_target",
            self.sft_warmup_target,
            "use a held-out exact-match accuracy in [0, 1] (0 = run all sft_warmup_steps)",
        )
        require(
            self.sft_warmup_eval_every >= 1,
            "sft_warmup_eval_every",
            self.sft_warmup_eval_every,
            "use a positive number of SFT steps between held-out checks",
        )
        if self.sft.max_length > self.schedule.max_tokens:
            raise ConfigError(
                f"sft.max_length={self.sft.max_length} exceeds schedule.max_tokens="
                f"{self.schedule.max_tokens}: a document must fit in one micro-batch row; raise "
                "schedule.max_tokens or lower sft.max_length"
            )

    @property
    def stage(self) -> GRPOConfig | DPOConfig | KTOConfig | None:
        """The section of the algorithm's own stage (``STAGE_SECTIONS``): its per-rank batch
        and learning rate; None for SFT."""
        name = STAGE_SECTIONS[self.algorithm]
        return None if name is None else getattr(self, name)

    @property
    def samples_rollouts(self) -> bool:
        """GRPO's family (GRPO, PPO): the run samples rollouts (the grpo and rollout sections)."""
        return isinstance(self.stage, GRPOConfig)

    @property
    def trains_critic(self) -> bool:
        """PPO: a value model is trained beside the policy (docs/algorithms/ppo.md)."""
        return self.algorithm in CRITIC_ALGORITHMS

    def resolved(self) -> RunConfig:
        """The one resolve step (``load_run_config`` runs it; nothing else fills a config in):
        a new config with the built-in task's defaults when neither ``task`` nor
        ``data.train`` is given, and the grpo / dpo sections at the mesh's data-parallel ranks
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
        """This config with the grpo and dpo sections resolved for ``ranks`` data-parallel
        ranks: what a run does at start when a mesh axis is -1 (``ranks`` from its devices).
        Raises the sections' ``ConfigError`` when their batches do not fit ``ranks``."""
        changed = self._sections_at(ranks)
        return dataclasses.replace(self, **changed) if changed else self

    def _sections_at(self, ranks: int) -> dict[str, Any]:
        """The grpo / dpo sections whose world size is not yet ``ranks``, resolved for it."""
        out: dict[str, Any] = {}
        with section("grpo"):
            if self.grpo.world_size != ranks:
                out["grpo"] = self.grpo.for_world_size(ranks)
        with section("dpo"):
            if self.dpo.world_size != ranks:
                out["dpo"] = dataclasses.replace(self.dpo, world_size=ranks)
        with section("kto"):
            if self.kto.world_size != ranks:
                out["kto"] = dataclasses.replace(self.kto, world_size=ranks)
        return out

    def _check_decode_layout(self) -> None:
        """``rollout.tensor_parallel`` divides the generation devices, checked when the config
        fixes their count (the whole mesh when synchronous; ``rollout.devices`` when set for a
        run that generates ahead), so a bad value stops the run before any stage, not after an
        SFT warm start. Otherwise the sampler's construction checks it."""
        t = self.rollout.tensor_parallel
        if self.algorithm not in ("grpo", "ppo") or t <= 1 or -1 in self.mesh.sizes:
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
        if self.sft_warmup_steps and self.algorithm != "sft":
            raise ConfigError(
                f"sft_warmup_steps={self.sft_warmup_steps} is invalid with data.train: the warm "
                f"start trains on the built-in task, and data.train holds {self.algorithm} rows; "
                "run SFT on your SFT data first and point model.path at its export "
                "(<output_dir>/hf), with sft_warmup_steps=0"
            )
