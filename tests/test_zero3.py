"""ZeRO-3 on 8 host devices: with fsdp > 1 the train step and the scorer keep the parameters
as fsdp shards and gather one scanned layer at a time inside the layer scan (jaxrl/models/fsdp.py,
jaxrl/train/accumulate.py). Checked here: where the gathers are in the step's jaxpr, that the
compiled temporaries do not grow by a gathered layer per layer, and that the numbers — loss,
grad norm and the updated parameters — are those of data parallelism, for SFT, DPO and GRPO,
with full fine-tuning and with LoRA."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxrl.cli import main
from jaxrl.config import load_run_config
from jaxrl.models import fsdp
from jaxrl.runtime.mesh import use_devices
from jaxrl.train.run_io.memory import abstract_batch, plan_memory, plan_run
from jaxrl.train.run_io.metrics import read_metrics

SCANNED = ["model.scan_layers=true", "model.remat=block"]
WIDTH = (  # a model whose every dimension fsdp=8 divides, the padded vocabulary included, so
    # the embedding and the LM head are vocabulary-parallel (tied, as ModelConfig.tiny makes it)
    "model.init={hidden_size: 64, num_hidden_layers: 2, num_attention_heads: 4, "
    "num_key_value_heads: 2, intermediate_size: 128, vocab_size: 64}"
)
UNTIED = WIDTH.replace("vocab_size: 64}", "vocab_size: 64, tie_word_embeddings: false}")
# Adam's first step is lr · g / (|g| + eps): sign(g) · lr wherever |g| >> eps, which turns the
# last-bit rounding of a near-zero gradient into a ±lr flip. eps = 1 makes the step linear in the
# gradient (about lr · g), so the updated parameters carry the gradient's rounding.
ONE_STEP = ["max_steps=1", "optimizer.warmup_steps=0", "optimizer.eps=1.0"]
JOBS = {  # one optimizer step of each trainer, fp32 (the configs' model.dtype)
    "sft": (
        "configs/sft_tiny.yaml",
        ["sft.per_device_train_batch_size={per32}", "optimizer.learning_rate=1.0",
         "task.eval_size=16"],
    ),
    "dpo": (
        "configs/dpo_tiny.yaml",
        ["warm_start.steps=0", "task.train_size=64", "task.eval_size=8",
         "optimizer.learning_rate=1.0", "dpo.per_device_train_batch_size={per16}"],
    ),
    "grpo": (
        "configs/grpo_tiny.yaml",
        ["warm_start.steps=0", "optimizer.warmup_steps=0", "optimizer.learning_rate=1.0",
         "grpo.num_generations=4", "grpo.max_completion_length=4", "task.train_size=64",
         "task.eval_size=8", "logging.eval_samples=0", "schedule.max_tokens=32",
         "grpo.per_device_train_batch_size={per16}"],
    ),
}  # fmt: skip
MESHES = {  # name → (overrides, batch ranks); data=8 is the reference
    "data8": (["mesh.data=8"], 8),
    "fsdp8": (["mesh.data=1", "mesh.fsdp=8"], 8),
    "d2f2t2": (["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"], 4),
}
RTOL = 1e-6
# bf16 master weights (docs/precision.md), rounded to nearest so the update is deterministic:
# one step agrees with data=8's to bf16 precision (test_precision.py's bf16 tolerance). The
# layouts round in different places: data=8 rounds each rank's gradient to bf16 before the fp32
# sum over ranks, ZeRO-3 reduce-scatters in fp32 and rounds the sum once.
BF16_MASTER = ["model.param_dtype=bfloat16", "optimizer.master_rounding=nearest"]
BF16_RTOL = 1e-2


def _batch_ranks(sets) -> int:
    """data × fsdp of the mesh the overrides give (mesh.data defaults to all 8 devices)."""
    sizes = {"data": 8, "fsdp": 1}
    for s in sets:
        key, _, value = s.partition("=")
        if key in ("mesh.data", "mesh.fsdp"):
            sizes[key.split(".")[1]] = int(value)
    return sizes["data"] * sizes["fsdp"]


def _train(out, config, sets):
    """One run; a job's ``{per16}`` / ``{per32}`` batch is per rank of the run's mesh, so every
    layout trains the same 16 / 32 documents."""
    ranks = _batch_ranks(sets)
    sets = [s.format(per16=16 // ranks, per32=32 // ranks) if "{per" in s else s for s in sets]
    args = ["train", config, "--set", f"output_dir={out}", "--set", "logging.progress=false"]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 0
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    weights = {}
    for f in sorted((out / "hf").glob("*.safetensors")):
        weights.update(load_file(f))
    return rows, weights


def _assert_same_step(runs, ref_name, rtol=RTOL):
    ref_rows, ref_w = runs[ref_name]
    for name, (rows, weights) in runs.items():
        assert len(rows) == len(ref_rows) == 1, name
        for key in ("loss", "grad_norm"):
            np.testing.assert_allclose(rows[0][key], ref_rows[0][key], rtol=rtol, err_msg=name)
        assert rows[0]["num_tokens"] == ref_rows[0]["num_tokens"]
        assert sorted(weights) == sorted(ref_w)
        for k, w in weights.items():
            w, r = w.astype(np.float64), ref_w[k].astype(np.float64)
            rel = np.linalg.norm(w - r) / max(np.linalg.norm(r), 1e-30)
            assert rel <= rtol, f"{name}: {k} differs by {rel:.2e} (relative norm)"


@pytest.mark.slow
@pytest.mark.parametrize("job", sorted(JOBS))
def test_zero3_step_equals_data_parallel(tmp_path, job):
    """fsdp=8 (ZeRO-3) and (data 2, fsdp 2, tensor 2) give data=8's loss, grad norm and updated
    parameters to 1e-6 relative after one step, scanned with block remat, fp32."""
    config, sets = JOBS[job]
    runs = {}
    for name, (mesh, _) in MESHES.items():
        runs[name] = _train(tmp_path / name, config, [WIDTH, *SCANNED, *ONE_STEP, *sets, *mesh])
    _assert_same_step(runs, "data8")


@pytest.mark.slow
@pytest.mark.parametrize("job", ["sft", "grpo"])
def test_zero3_bf16_masters_step_equals_data_parallel(tmp_path, job):
    """bf16 master weights (and bf16 compute) on fsdp=8 and (data 2, fsdp 2, tensor 2) give
    data=8's loss, grad norm and updated parameters to bf16 precision after one step. (Their
    bf16 reduce-scatter once aborted XLA:CPU's compiler: fsdp.embed sums in fp32.)"""
    config, sets = JOBS[job]
    runs = {}
    for name, (mesh, _) in MESHES.items():
        runs[name] = _train(
            tmp_path / name, config, [WIDTH, *SCANNED, *ONE_STEP, *BF16_MASTER, *sets, *mesh]
        )
    assert {w.dtype.name for w in runs["fsdp8"][1].values()} == {"bfloat16"}
    _assert_same_step(runs, "data8", BF16_RTOL)


def _sft_fsdp8_equals_data8(tmp_path, width):
    config, sets = JOBS["sft"]
    runs = {}
    for name in ("data8", "fsdp8"):
        mesh = MESHES[name][0]
        runs[name] = _train(tmp_path / name, config, [width, *SCANNED, *ONE_STEP, *sets, *mesh])
    _assert_same_step(runs, "data8")


@pytest.mark.slow
def test_zero3_untied_head_equals_data_parallel(tmp_path):
    """An untied LM head (its own [D, V] kernel, split over its vocabulary columns) too."""
    _sft_fsdp8_equals_data8(tmp_path, UNTIED)


@pytest.mark.slow
def test_zero3_chunked_lookup_and_head_equal_data_parallel(tmp_path, monkeypatch):
    """With the vocabulary-parallel lookup and head cut into small token chunks (as at fsdp=128
    on a 72B model), one step still equals data=8's."""
    monkeypatch.setattr(fsdp, "LOOKUP_WHOLE", 0)
    monkeypatch.setattr(fsdp, "LOOKUP_VALUES", 16 * 8 * 64)  # 16-token chunks
    monkeypatch.setattr(fsdp, "HEAD_VALUES", 16 * 8 * 64)
    _sft_fsdp8_equals_data8(tmp_path, WIDTH)


@pytest.mark.slow
@pytest.mark.parametrize("quantize", ["none", "int8"])
def test_zero3_lora_equals_one_device(tmp_path, quantize):
    """LoRA and QLoRA on fsdp=4 (a frozen base — quantised codes and scales — and adapters, all
    as fsdp shards) equal one device."""
    config, sets = JOBS["sft"]
    lora = ["model.lora.rank=4", "model.lora.alpha=8", f"model.lora.quantize={quantize}"]
    runs = {}
    for name, mesh in {"data1": ["mesh.data=1"], "fsdp4": ["mesh.data=1", "mesh.fsdp=4"]}.items():
        with use_devices(jax.devices()[: 4 if name == "fsdp4" else 1]):
            runs[name] = _train(
                tmp_path / name, config, [WIDTH, *SCANNED, *ONE_STEP, *sets, *lora, *mesh]
            )
    _assert_same_step(runs, "data1")


def _walk(jaxpr, ancestors=()):
    """(primitive name, enclosing primitive names, outvars) of every equation, recursively."""
    for eqn in jaxpr.eqns:
        yield eqn.primitive.name, ancestors, eqn.outvars
        for sub in _sub_jaxprs(eqn.params):
            yield from _walk(sub, (*ancestors, eqn.primitive.name))


def _sub_jaxprs(params):
    for value in params.values():
        for v in value if isinstance(value, tuple | list) else (value,):
            if hasattr(v, "eqns"):
                yield v
            elif hasattr(v, "jaxpr") and hasattr(v.jaxpr, "eqns"):
                yield v.jaxpr


def test_zero3_gathers_each_layer_inside_the_layer_scan():
    """In the fsdp=8 step, every layer weight is all-gathered inside the layer scan (and again
    in its backward scan); outside it only the final norm's scale is: the embedding and the LM
    head are vocabulary-parallel and never gathered."""
    sets = ["mesh.data=1", "mesh.fsdp=8", "schedule.max_tokens=32"]
    cfg = load_run_config("configs/sft_tiny.yaml", [WIDTH, *SCANNED, *sets])
    run = plan_run(cfg)
    batch = abstract_batch(run.mesh, 32)
    bounds = jax.ShapeDtypeStruct((2,), np.int32)
    jaxpr = jax.make_jaxpr(run.step._step)(run.state, batch, bounds, None).jaxpr
    gathers = [(anc, outs) for name, anc, outs in _walk(jaxpr) if name == "all_gather"]
    in_scan = [outs for anc, outs in gathers if "scan" in anc[anc.index("shard_map") :]]
    outside = [outs for anc, outs in gathers if "scan" not in anc[anc.index("shard_map") :]]
    assert all("shard_map" in anc for anc, _ in gathers)
    d, v = cfg.model.init["hidden_size"], run.model_config.vocab_size
    layer_weights = 7 + 2  # q, k, v, o, gate, up, down kernels; two norm scales
    assert len(in_scan) >= 2 * layer_weights  # forward and the recomputing backward
    shapes = {tuple(o.aval.shape) for outs in outside for o in outs}
    # outside the scan: the final norm's scale and the vocabulary-parallel lookup's token ids
    # and activation cotangents ([fsdp, B, T(, D)]); never a weight: no embedding, no head
    assert (d,) in shapes and not shapes & {(v, d), (d, v)}, shapes
    assert all(shape == (d,) or shape[0] == 8 for shape in shapes), shapes
    table = run.shardings.params["embedding"].get_value()
    assert table.spec[0] == "fsdp"  # [V, D] split over its vocabulary: vocabulary-parallel
    assert (v, d) not in [tuple(o.aval.shape) for outs in in_scan for o in outs]


def _temp(layers, remat):
    width = (
        "model.init={hidden_size: 1024, num_attention_heads: 8, num_key_value_heads: 8, "
        f"intermediate_size: 4096, num_hidden_layers: {layers}}}"
    )
    sets = [width, "model.scan_layers=true", f"model.remat={remat}", "model.dtype=bfloat16"]
    sets += ["mesh.data=1", "mesh.fsdp=8", f"schedule.max_tokens={TOKENS}"]
    return plan_memory(load_run_config("configs/sft_tiny.yaml", sets))


TOKENS = 32  # short rows: a layer's weights outweigh its activations many times


@pytest.mark.parametrize(
    "remat", ["block", pytest.param("none", marks=pytest.mark.slow), "everything_saveable"]
)
def test_zero3_temporaries_grow_by_activations_not_by_gathered_layers(remat):
    """Four more layers (8 vs 4) add their share of the sharded fp32 gradient (the backward
    scan's stacked layer gradients) and their saved activations — never a gathered weight
    (33.6 MB in bf16 here), under any remat: "none" saves every matmul output, not the
    weights' reshapes."""
    small, big = _temp(4, remat), _temp(8, remat)
    per_layer = (big["temp_bytes"] - small["temp_bytes"]) / 4
    params = (big["num_params"] - small["num_params"]) / 4
    sharded_fp32 = 4 * params / 8
    activations = 16 * TOKENS * (4 * 1024 + 3 * 4096)  # generous: 16 bytes a saved value
    assert per_layer <= sharded_fp32 + activations, (per_layer, sharded_fp32, activations)
    assert per_layer < 2 * params / 2  # under half a gathered bf16 layer
