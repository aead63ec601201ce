"""Scale-out on 8 host devices: the (data, fsdp, tensor) mesh changes where things are computed,
never the numbers; parameters really are sharded; checkpoints move between meshes."""

from __future__ import annotations

import shutil

import jax
import numpy as np
import pytest

from jaxrl.cli import main
from jaxrl.config import ConfigError, load_run_config
from jaxrl.models.sharding import bytes_per_device
from jaxrl.runtime.mesh import make_mesh, resolve_shape, use_devices
from jaxrl.train.run_io.metrics import read_metrics
from jaxrl.trainers.sft import SFTTrainer

MESHES = {  # name → (--set overrides, data-parallel ranks); (data=8) is the reference
    "data8": (["mesh.data=8"], 8),
    "d2f2t2": (["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"], 4),
    "fsdp8": (["mesh.data=1", "mesh.fsdp=8"], 8),
}
GLOBAL_BATCH = {  # per-device batch fields (TRL semantics) → the global batch they must make
    "sft": ("sft.per_device_train_batch_size", 32),
    "grpo": ("grpo.per_device_train_batch_size", 16),
    "dpo": ("dpo.per_device_train_batch_size", 16),
}
SMALL_MODEL = (
    "model.init={hidden_size: 64, num_hidden_layers: 2, num_attention_heads: 4, "
    "num_key_value_heads: 2, intermediate_size: 128}"
)
JOBS = {
    "sft": (
        "configs/sft_tiny.yaml",
        [SMALL_MODEL, "max_steps=3", "optimizer.warmup_steps=0",
         "optimizer.learning_rate=3e-3", "task.eval_size=16"],
    ),
    "grpo": (
        "configs/grpo_tiny.yaml",
        [SMALL_MODEL, "max_steps=3", "warm_start.steps=0", "optimizer.warmup_steps=0",
         "optimizer.learning_rate=3e-3", "grpo.num_generations=4",
         "grpo.max_completion_length=4", "task.train_size=64", "task.eval_size=8",
         "logging.eval_samples=0", "schedule.max_tokens=32"],
    ),
    "dpo": (
        "configs/dpo_tiny.yaml",
        [SMALL_MODEL, "max_steps=3", "warm_start.steps=0", "task.train_size=64",
         "task.eval_size=8", "optimizer.learning_rate=1e-3",
         "optimizer.warmup_steps=0"],
    ),
}  # fmt: skip
STEP_KEYS = ("loss", "grad_norm")


def _run(out, config, *overrides):
    args = ["train", config, "--set", f"output_dir={out}", "--set", "logging.progress=false"]
    for o in overrides:
        args += ["--set", o]
    assert main(args) == 0
    return [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]


@pytest.mark.slow
@pytest.mark.parametrize("job", sorted(JOBS))
def test_every_mesh_gives_the_data8_numbers(tmp_path, job):
    """(data=2, fsdp=2, tensor=2) and (data=1, fsdp=8) agree with (data=8) per step (1e-4)."""
    config, sets = JOBS[job]
    runs = {}
    for name, (mesh, ranks) in MESHES.items():
        batch = []
        if job in GLOBAL_BATCH:  # the same global batch on every mesh
            field, size = GLOBAL_BATCH[job]
            batch = [f"{field}={size // ranks}"]
        runs[name] = _run(tmp_path / name, config, *sets, *mesh, *batch)
    ref = runs["data8"]
    assert len(ref) == 3
    for name, rows in runs.items():
        assert [r["num_documents"] for r in rows] == [r["num_documents"] for r in ref]
        assert [r["num_tokens"] for r in rows] == [r["num_tokens"] for r in ref]
        for key in STEP_KEYS:
            np.testing.assert_allclose(
                [r[key] for r in rows], [r[key] for r in ref], rtol=1e-4, err_msg=f"{name} {key}"
            )


def test_parameters_and_moments_are_sharded_over_fsdp(tmp_path):
    cfg = load_run_config(
        "configs/sft_tiny.yaml",
        [SMALL_MODEL, f"output_dir={tmp_path}", "mesh.data=1", "mesh.fsdp=8"],
    )
    trainer = SFTTrainer(cfg)
    state = trainer.session.state
    total = sum(x.nbytes for x in jax.tree.leaves(state.params))
    per_device = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state.params))
    # every parameter has an embed dimension (split 8 ways) but the embedding and LM head, which
    # are split over their vocabulary when 8 divides it and are whole otherwise
    vocab = state.params["embedding"][...].shape[0]
    tables = sum(
        state.params[name][...].nbytes for name in ("embedding", "lm_head") if name in state.params
    )
    whole = 0 if vocab % 8 == 0 else tables
    assert per_device == (total - whole) // 8 + whole
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
    assert sum(x.addressable_shards[0].data.nbytes for x in moments) == 2 * per_device
    shardings = jax.tree.map(lambda x: x.sharding, state.params)
    assert bytes_per_device(state.params, shardings) == per_device
    # The train step returns the state in the same shardings (no silent replication).
    trainer.session.train_on(trainer.next_batch())
    after = trainer.session.state
    assert jax.tree.map(lambda x: x.sharding, after.params) == shardings
    leaf = jax.tree.leaves(after.params["layers"])[0]  # a layer weight: split 8 ways
    assert leaf.addressable_shards[0].data.nbytes == leaf.nbytes // 8


@pytest.mark.slow
@pytest.mark.parametrize("resume_on", ["d2f4", "one_device"])
def test_a_data8_checkpoint_resumes_on_another_mesh(tmp_path, resume_on):
    config, sets = JOBS["sft"]
    sets = [*sets, "max_steps=4", "checkpoint.every=2", "checkpoint.keep=2"]
    per_rank = GLOBAL_BATCH["sft"][0]  # 32 documents a step on every mesh
    full = _run(tmp_path / "full", config, *sets, "mesh.data=8", f"{per_rank}=4")
    part = tmp_path / "part"
    shutil.copytree(tmp_path / "full", part)
    shutil.rmtree(part / "checkpoints" / "4")  # as if the run had stopped after step 2
    mesh = {
        "d2f4": ["mesh.data=2", "mesh.fsdp=4", f"{per_rank}=4"],
        "one_device": ["mesh.data=1", f"{per_rank}=32"],
    }[resume_on]
    resumed = _run(part, config, *sets, *mesh)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for key in STEP_KEYS:
        np.testing.assert_allclose(
            [r[key] for r in resumed[2:]], [r[key] for r in full[2:]], rtol=1e-4
        )


def test_the_mesh_must_use_every_device():
    with pytest.raises(ConfigError, match="uses 4 devices but 8 devices are visible"):
        resolve_shape(2, 2, 1, 8)
    with pytest.raises(ConfigError, match="both -1"):
        resolve_shape(-1, -1, 1, 8)
    with pytest.raises(ConfigError, match="does not divide the 8 devices"):
        resolve_shape(-1, 3, 1, 8)
    assert resolve_shape(2, -1, 2, 8) == (2, 2, 2)
    with use_devices(jax.devices()):  # strict: a mesh of 2 on 8 devices is an error
        with pytest.raises(ConfigError, match="8 devices are visible"):
            make_mesh(2)
