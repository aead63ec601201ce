"""``jaxrl memory``: per-device memory planned from abstract shapes and an AOT compile of the
real train step, never allocating the model."""

from __future__ import annotations

import json
import resource
from collections import defaultdict

import jax
import pytest

from jaxrl.cli import main
from jaxrl.config import load_run_config
from jaxrl.data.tokenizer import char_tokenizer
from jaxrl.generate.cache_geometry import batch_bucket
from jaxrl.runtime.mesh import mesh_from_config, use_devices
from jaxrl.train.build import build_model, build_task
from jaxrl.train.optimizer import make_optimizer
from jaxrl.train.run_io.memory import plan_memory
from jaxrl.train.state import create_state

TINY = "configs/sft_tiny.yaml"
TINY_8 = ["mesh.data=2", "mesh.fsdp=4"]
AS_GRPO = ["algorithm=grpo", "sft=null"]  # sft_tiny's model as a GRPO run (no sft section)
PARTS = (
    "params_bytes",
    "optimizer_bytes",
    "grads_bytes",
    "compute_copy_bytes",
    "kv_cache_bytes",
    "critic_bytes",
    "temp_bytes",
)
QWEN25_7B = {  # Qwen2.5-7B's config.json shape
    "model_type": "qwen2",
    "vocab_size": 152064,
    "hidden_size": 3584,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "intermediate_size": 18944,
    "tie_word_embeddings": False,
}


def _overrides(init: dict, **sets) -> list[str]:
    items = [f"model.init.{k}={json.dumps(v)}" for k, v in init.items()]
    return items + [f"{k}={v}" for k, v in sets.items()]


def _qwen_params(v: int, d: int, layers: int, h: int, k: int, dh: int, f: int) -> int:
    """Parameters of a Qwen2 model: embedding, untied head, q/k/v/o (+ q/k/v biases), SwiGLU
    MLP, two norms per block and the final norm."""
    attn = d * h * dh + 2 * d * k * dh + h * dh * d + h * dh + 2 * k * dh
    return 2 * v * d + layers * (attn + 3 * d * f + 2 * d) + d


def _largest_device_bytes(tree) -> int:
    """Bytes the fullest device really holds of a tree of placed arrays."""
    per_device = defaultdict(int)
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            per_device[shard.device] += shard.data.nbytes
    return max(per_device.values())


@pytest.fixture(scope="module")
def qwen7b():
    """Plans of the Qwen2.5-7B shape on fsdp=8 and data=8 (T = 256), with the arrays that were
    alive before, to check that planning allocated nothing model-sized."""
    before = {id(x) for x in jax.live_arrays()}
    plans = {}
    for name, mesh in (("fsdp", ["mesh.data=1", "mesh.fsdp=8"]), ("data", ["mesh.data=8"])):
        sets = _overrides(QWEN25_7B, **{"model.dtype": "bfloat16"})  # fp32 master, bf16 compute
        scan = "model.scan_layers=true"  # one compiled layer: a quarter of the compile time
        cfg = load_run_config(TINY, [*sets, *mesh, scan, "schedule.max_tokens=256"])
        plans[name] = plan_memory(cfg)
    new = [x for x in jax.live_arrays() if id(x) not in before]
    return plans, new


@pytest.mark.slow  # two compiles of the (scanned) 28-layer step
def test_qwen25_7b_fits_the_plan_and_fsdp_divides_the_state(qwen7b):
    plans, new_arrays = qwen7b
    fsdp, data = plans["fsdp"], plans["data"]
    n = _qwen_params(152064, 3584, 28, 28, 4, 128, 18944)
    assert fsdp["num_params"] == data["num_params"] == n
    assert abs(n - 7.6e9) / 7.6e9 < 0.01  # Qwen2.5-7B: 7.61B parameters
    # data=8: every device holds the whole state: fp32 masters, two fp32 moments (+ counts)
    assert data["params_bytes"] == 4 * n == data["unsharded_params_bytes"]
    assert 0 <= data["optimizer_bytes"] - 8 * n < 1024
    assert data["grads_bytes"] == 4 * n
    # fsdp=8: parameters and moments split eight ways (norms and biases may stay whole)
    replicated = data["params_bytes"] + data["optimizer_bytes"]
    assert fsdp["params_bytes"] + fsdp["optimizer_bytes"] <= 1.05 * replicated / 8
    assert fsdp["grads_bytes"] <= 1.05 * data["grads_bytes"] / 8
    for plan in (fsdp, data):
        assert plan["devices"] == 8 and plan["model"]["num_hidden_layers"] == 28
        assert plan["temp_bytes"] > 0
        assert plan["total_bytes"] == sum(plan[k] for k in PARTS)
    assert fsdp["total_bytes"] < data["total_bytes"]
    # nothing was allocated: no new live array beyond a few bytes, and the process never held
    # even one fp32 copy of the parameters (30 GB; the replicated state would be 91 GB)
    assert sum(x.nbytes for x in new_arrays) < 1 << 20
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    assert peak_rss < data["unsharded_params_bytes"]


def test_json_has_int_parts_that_sum_to_the_total(capsys):
    code = main(["memory", TINY, *[a for s in TINY_8 for a in ("--set", s)], "--json"])
    assert code == 0
    plan = json.loads(capsys.readouterr().out)  # stdout holds exactly one JSON object
    for key in (*PARTS, "total_bytes", "devices", "argument_bytes", "output_bytes", "num_params"):
        assert isinstance(plan[key], int) and plan[key] >= 0, key
    assert plan["total_bytes"] == sum(plan[k] for k in PARTS)
    assert plan["devices"] == 8 and plan["mesh"] == {"data": 2, "fsdp": 4, "tensor": 1}
    assert plan["loss"] == "sft" and plan["max_tokens"] == 256
    # the gradient accumulator is one of XLA's temporaries: counted once, as grads_bytes
    assert plan["compiled_temp_bytes"] == plan["temp_bytes"] + plan["grads_bytes"]


def test_table_names_the_parts_and_the_total(capsys):
    assert main(["memory", TINY, *[a for s in TINY_8 for a in ("--set", s)]]) == 0
    out = capsys.readouterr().out
    for word in ("master weights", "optimizer", "gradients", "temporaries", "total", "fsdp=4"):
        assert word in out


@pytest.mark.slow
def test_grpo_counts_the_compute_dtype_copies_of_the_sampler_and_the_reference():
    """fp32 masters + bf16 compute on (data 2, fsdp 4): the master is 4 bytes a parameter split
    8 ways; the sampler's copy is 2 bytes a parameter in its decode layout (a tiny model: a whole
    copy per device, docs/scale_out.md); the reference's (β > 0) 2 bytes in the trainer's
    layout; all of them are in the total."""
    sets = ["model.dtype=bfloat16", *AS_GRPO, *TINY_8]
    plans = {
        beta: plan_memory(load_run_config(TINY, [*sets, f"grpo.beta={beta}"]))
        for beta in (0.0, 0.04)
    }
    for beta, copies in ((0.0, 1), (0.04, 2)):
        plan = plans[beta]
        sampler = plan["unsharded_params_bytes"] // 2
        reference = plan["params_bytes"] // 2 if beta else 0
        assert plan["decode"]["tensor_parallel"] == 1
        assert plan["decode"]["mesh"] == {"data": 8, "fsdp": 1, "tensor": 1}
        assert plan["compute_copies"] == copies
        assert plan["compute_copy_bytes"] == sampler + reference
        assert plan["total_bytes"] == sum(plan[k] for k in PARTS)
    sft = plan_memory(load_run_config(TINY, ["model.dtype=bfloat16", *TINY_8]))
    assert sft["compute_copy_bytes"] == 0 and sft["params_bytes"] == plans[0.0]["params_bytes"]
    assert sft["kv_cache_bytes"] == 0 and sft["decode"] is None
    tensor = plan_memory(load_run_config(TINY, [*sets, "rollout.tensor_parallel=2"]))
    assert tensor["decode"]["mesh"] == {"data": 4, "fsdp": 1, "tensor": 2}
    assert tensor["compute_copy_bytes"] < plans[0.0]["compute_copy_bytes"]  # heads, mlp split
    assert plans[0.0]["critic_bytes"] == 0
    ppo = plan_memory(load_run_config(TINY, [*sets, "algorithm=ppo"]))  # + the critic's state
    state = sum(ppo[k] for k in ("params_bytes", "optimizer_bytes", "grads_bytes"))
    assert ppo["critic_bytes"] == state
    assert ppo["total_bytes"] == sum(ppo[k] for k in PARTS)


def test_grpo_counts_the_sampler_kv_cache_and_reads_fp32_weights_in_place():
    """The sampler's KV caches are in the total; rollout.max_slots shrinks the decode cache;
    a synchronous fp32 run on a data-parallel mesh (already the decode layout) holds no sampler
    copy; generation ahead of training, or ZeRO-3 shards, hold one."""
    sets = [*AS_GRPO, "mesh.data=8"]
    cfg = load_run_config(TINY, sets)
    full = plan_memory(cfg)
    assert full["total_bytes"] == sum(full[k] for k in PARTS)
    g, model = cfg.grpo, full["model"]
    p = batch_bucket(g.max_prompt_length)
    entry = 2 * model["num_hidden_layers"] * model["num_key_value_heads"] * model["head_dim"] * 4
    length = -(-(p + g.max_completion_length) // 64) * 64  # decode-attention blocks
    slots = -(-g.generation.size // 8)  # one per completion, over 8 batch ranks
    groups = g.generation.size // g.num_generations
    assert full["kv_cache_bytes"] == entry * (slots * length + groups * p) > 0
    few = plan_memory(load_run_config(TINY, [*sets, "rollout.max_slots=8"]))
    assert few["kv_cache_bytes"] == entry * (1 * length + groups * p)  # 8 over 8 ranks
    assert full["compute_copies"] == 0
    # mesh.data=-1 (the devices decide the ranks, and with them the generation batch) plans
    # the same sampler as the fixed mesh
    open_mesh = plan_memory(load_run_config(TINY, [*AS_GRPO, "mesh.data=-1"]))
    assert open_mesh["kv_cache_bytes"] == full["kv_cache_bytes"]
    ahead = plan_memory(load_run_config(TINY, [*sets, "rollout.max_staleness=1"]))
    zero3 = plan_memory(load_run_config(TINY, [*AS_GRPO, *TINY_8]))
    # the engine decodes unrolled: stacked trainer layers are copied at each weight sync
    scanned = plan_memory(load_run_config(TINY, [*sets, "model.scan_layers=true"]))
    assert ahead["compute_copies"] == zero3["compute_copies"] == scanned["compute_copies"] == 1
    kept = ["model.scan_layers=true", "rollout.scan_layers=true"]  # decodes in the layer scan
    assert plan_memory(load_run_config(TINY, [*sets, *kept]))["compute_copies"] == 0


def test_a_mesh_that_does_not_match_the_devices_exits_2_naming_both_counts(capsys):
    with use_devices(jax.devices()):  # strict, as outside the test suite's device pool
        code = main(["memory", TINY, "--set", "mesh.data=2", "--json"])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    err = captured.err.strip()
    assert err.startswith("config error: ") and "\n" not in err
    assert "uses 2 devices but 8 devices are visible" in err


def test_params_and_optimizer_bytes_equal_a_real_sharded_state():
    cfg = load_run_config(TINY, TINY_8)
    plan = plan_memory(cfg)
    vocab = char_tokenizer(build_task(cfg).alphabet).vocab_size
    assert plan["model"]["vocab_size"] == vocab  # sized by the task's tokenizer, as trainers do
    mesh = mesh_from_config(cfg.mesh)
    _, init, _ = build_model(cfg, vocab, mesh)
    state, _ = create_state(init, make_optimizer(cfg.optimizer, cfg.max_steps), cfg.seed, mesh)
    assert plan["params_bytes"] == _largest_device_bytes(state.params)
    assert plan["optimizer_bytes"] == _largest_device_bytes(state.opt_state)
    assert plan["num_params"] == sum(x.size for x in jax.tree.leaves(state.params))


def test_vocabulary_from_init_or_from_a_config_json_without_weights(tmp_path):
    small = {"hidden_size": 64, "num_hidden_layers": 1, "intermediate_size": 128}
    plan = plan_memory(load_run_config(TINY, _overrides({**small, "vocab_size": 1000})))
    assert plan["model"]["vocab_size"] == 1000
    hf = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": 500,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": False,
    }
    (tmp_path / "config.json").write_text(json.dumps(hf))  # no weights: only the shape is read
    plan = plan_memory(load_run_config(TINY, [f"model.path={tmp_path}"]))
    assert plan["model"]["vocab_size"] == 500 and plan["model"]["model_type"] == "qwen2"
    assert plan["num_params"] == _qwen_params(500, 64, 2, 4, 2, 16, 128)


def test_budget_says_whether_it_fits_and_what_would(capsys):
    """``--budget GB``: a plan under it fits; over it, the largest halved token budget that
    fits, else an fsdp size that divides the state enough (an estimate)."""
    args = ["memory", TINY, "--json", "--set", "mesh.data=8"]
    assert main([*args, "--budget", "100"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] is True and plan["suggestion"] is None
    long_rows = [*args, "--set", "schedule.max_tokens=4096"]
    tight = plan_memory(load_run_config(TINY, ["mesh.data=8", "schedule.max_tokens=1024"]))
    assert main([*long_rows, "--budget", str(1.001 * tight["total_bytes"] / 1e9)]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] is False
    assert plan["suggestion"] == {"schedule.max_tokens": 1024, "total_bytes": tight["total_bytes"]}
    at512 = plan_memory(load_run_config(TINY, ["mesh.data=8", "schedule.max_tokens=512"]))
    state = sum(at512[k] for k in ("params_bytes", "optimizer_bytes", "grads_bytes"))
    rest = at512["total_bytes"] - state  # no token budget fits: twice the fsdp would
    assert main([*long_rows, "--budget", str((rest + state / 2 + 1) / 1e9)]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] is False
    assert plan["suggestion"] == {"mesh.fsdp": 2, "estimated_total_bytes": int(rest + state / 2)}
    assert main([*args, "--budget", "-1"]) == 2
