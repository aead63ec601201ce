"""Expert parallelism (mesh.expert, jaxrl/models/moe/expert_parallel.py) does not change the
update: one SFT step of a tiny Qwen3-MoE (8 experts, top-2; scanned, block remat, fp32) on
data=8, on (data 2, expert 4) and on (data 2, fsdp 2, expert 2) — ZeRO-3 shards of the experts
too — and with 4× as many micro-batches, gives the same loss, grad norm and updated parameters
to 1e-6 relative, with the load-balance loss on (its value too); ``jaxrl memory`` plans an
expert mesh."""

from __future__ import annotations

import pytest
from test_zero3 import JOBS, ONE_STEP, SCANNED, _assert_same_step, _train

from jaxrl.config import load_run_config
from jaxrl.train.run_io.memory import plan_memory

MOE = (
    "model.init={model_type: qwen3_moe, hidden_size: 64, num_hidden_layers: 2, "
    "num_attention_heads: 4, num_key_value_heads: 2, intermediate_size: 128, vocab_size: 64, "
    "num_experts: 8, num_experts_per_tok: 2, moe_intermediate_size: 32, norm_topk_prob: true}"
)
# the load-balance loss on (jaxrl/losses/load_balance.py): its step-wide expert fractions make
# it layout-invariant too
BALANCED = MOE.replace("norm_topk_prob: true}", "norm_topk_prob: true, router_aux_loss_coef: 0.5}")
MESHES = {
    "data8": ["mesh.data=8"],
    "d2e4": ["mesh.data=2", "mesh.expert=4"],
    "d2f2e2": ["mesh.data=2", "mesh.fsdp=2", "mesh.expert=2"],
    "d2e4_4x_micro": ["mesh.data=2", "mesh.expert=4", "schedule.max_tokens=32"],
}


@pytest.mark.slow
def test_expert_parallel_step_equals_data_parallel(tmp_path):
    config, sets = JOBS["sft"]
    runs = {
        name: _train(tmp_path / name, config, [BALANCED, *SCANNED, *ONE_STEP, *sets, *mesh])
        for name, mesh in MESHES.items()
    }
    _assert_same_step(runs, "data8")
    aux = {name: rows[0]["moe/aux_loss"] for name, (rows, _) in runs.items()}
    assert all(abs(a / aux["data8"] - 1) <= 1e-6 for a in aux.values()), aux
    assert 0 < aux["data8"] <= 0.5 * 8  # coef · K when balanced, at most coef · E
    micro = {name: rows[0]["num_micro_batches"] for name, (rows, _) in runs.items()}
    assert micro["d2e4_4x_micro"] >= 4 * micro["d2e4"], micro


def test_memory_plans_an_expert_mesh():
    cfg = load_run_config(
        "configs/sft_tiny.yaml",
        [MOE, "mesh.data=2", "mesh.expert=4", "model.scan_layers=true"],
    )
    plan = plan_memory(cfg)
    assert plan["mesh"] == {"data": 2, "fsdp": 1, "expert": 4, "tensor": 1}
    one = plan_memory(load_run_config("configs/sft_tiny.yaml", [MOE, "mesh.data=8"]))
    # 3 · 8 · 64 · 32 expert weights per layer: a quarter of them per device on expert=4
    assert plan["params_bytes"] < one["params_bytes"]


GRPO_MOE = [
    "warm_start.steps=0", "max_steps=2", "grpo.num_generations=4", "grpo.max_completion_length=4",
    "task.train_size=64", "task.eval_size=8", "logging.eval_samples=0",
    "schedule.max_tokens=64", "grpo.per_device_train_batch_size=16", "model.dtype=bfloat16",
]  # fmt: skip


@pytest.mark.slow
def test_grpo_moe_logs_route_disagreement_and_replay_zeroes_it(tmp_path):
    """configs/grpo_tiny_moe.yaml in bf16: moe/route_disagreement is logged every step; with
    grpo.router_replay=rollout the training forward takes the sampler's routes, so it is 0."""
    from jaxrl.cli import main
    from jaxrl.train.run_io.metrics import read_metrics

    seen = {}
    for replay in ("none", "rollout"):
        out = tmp_path / replay
        args = ["train", "configs/grpo_tiny_moe.yaml", "--set", f"output_dir={out}"]
        for s in [*GRPO_MOE, "logging.progress=false", f"grpo.router_replay={replay}"]:
            args += ["--set", s]
        assert main(args) == 0
        rows = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
        seen[replay] = [r["moe/route_disagreement"] for r in rows]
    assert len(seen["none"]) == 2 and all(0 <= d < 0.5 for d in seen["none"])
    assert seen["rollout"] == [0.0, 0.0]


def test_expert_mesh_without_batch_ranks_is_a_config_error():
    from jaxrl.runtime.errors import ConfigError
    from jaxrl.runtime.mesh import make_mesh

    with pytest.raises(ConfigError, match="mesh.expert=8"):
        make_mesh(1, 1, 1, expert=8)
    assert make_mesh(2, 1, 1, expert=4).shape == {"data": 2, "fsdp": 1, "expert": 4, "tensor": 1}


def test_moe_lora_fsdp_bf16_plans_on_cpu(monkeypatch):
    """LoRA on a MoE model under ZeRO-3 in bf16 once aborted XLA's CPU compiler (its
    all-reduce-promotion pass could not clone the bf16 reduce-scatter of the vocabulary-parallel
    lookup of the frozen bf16 embedding); the lookup sums in fp32 and the step compiles, without
    any XLA flag. tests/test_memory_combinations.py plans every layout in a subprocess."""
    sets = [MOE, "mesh.data=4", "mesh.fsdp=2", "model.dtype=bfloat16", "model.lora.rank=4"]
    sets += ["model.scan_layers=true", "model.remat=block", "schedule.max_tokens=32"]
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    plan = plan_memory(load_run_config("configs/sft_tiny.yaml", sets))
    assert plan["mesh"]["fsdp"] == 2 and plan["lora"] is not None and plan["temp_bytes"] > 0


def test_sampler_decode_layout_takes_the_expert_axis():
    """The sampler's decode mesh (jaxrl/generate/decode_layout.py) of a MoE model keeps the run's
    ``mesh.expert`` (reduced to a divisor of N / t; data = 1 allowed), a dense model's has none;
    ``jaxrl memory`` counts the sampler's expert-split copy: 3/4 of the expert kernels leave
    each device on expert=4 (abstract: nothing compiles)."""
    from jaxrl.generate.decode_layout import sampler_mesh
    from jaxrl.models.model_config import ModelConfig
    from jaxrl.runtime.mesh import make_mesh
    from jaxrl.train.run_io.memory import _decode_plan, plan_run

    moe = ModelConfig.tiny(64, model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2,
                           moe_intermediate_size=8)  # fmt: skip
    dense = ModelConfig.tiny(64)
    trainer = make_mesh(2, 1, 1, expert=4)
    shape = lambda config, t: dict(sampler_mesh(trainer, config, t, 100.0).shape)  # noqa: E731
    assert sampler_mesh(trainer, moe, 0, 100.0) is trainer
    assert shape(moe, 2) == {"data": 1, "fsdp": 1, "expert": 4, "tensor": 2}
    assert shape(moe, 4) == {"data": 1, "fsdp": 1, "expert": 2, "tensor": 4}
    assert shape(dense, 0) == {"data": 8, "fsdp": 1, "tensor": 1}

    decode = {}
    for e, mesh in ((1, ["mesh.data=8"]), (4, ["mesh.data=2", "mesh.expert=4"])):
        cfg = load_run_config("configs/grpo_tiny.yaml", [MOE, *mesh, "model.dtype=bfloat16"])
        run = plan_run(cfg)
        decode[e] = _decode_plan(cfg, run.model_config, run.mesh)[0]
    assert decode[4]["mesh"] == {"data": 2, "fsdp": 1, "expert": 4, "tensor": 1}
    assert (decode[1]["expert_parallel"], decode[4]["expert_parallel"]) == (1, 4)
    assert decode[4]["weight_bytes"] == decode[1]["weight_bytes"]
    experts = 2 * 3 * 8 * 64 * 32 * 2  # layers · kernels · E · D · F · bf16 bytes
    saved = decode[1]["device_weight_bytes"] - decode[4]["device_weight_bytes"]
    assert saved == experts * 3 // 4
