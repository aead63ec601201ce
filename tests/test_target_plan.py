"""``jaxrl memory --topology``: every program of a run compiled by the target's own compiler
(libtpu for TPU topologies, the CUDA plugin for GPU nodes), on this CPU-only machine.

The compiles need ``jaxrl[tpu-plan]`` / ``jaxrl[gpu-plan]``; without them those tests skip. Each
target's run is compiled once per module (slow tier); the name table and the verdict parsing are
fast.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from jaxrl.cli import main
from jaxrl.config import ConfigError
from jaxrl.runtime.targets import GIB, gpu_budget_bytes, hbm_from_message, parse_target

HAS_TPU = importlib.util.find_spec("libtpu") is not None
HAS_GPU = importlib.util.find_spec("jax_plugins") is not None and (
    importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
)
needs_tpu = pytest.mark.skipif(
    not HAS_TPU, reason="libtpu not installed: pip install jaxrl[tpu-plan]"
)
needs_gpu = pytest.mark.skipif(
    not HAS_GPU, reason="the CUDA PJRT plugin is not installed: pip install jaxrl[gpu-plan]"
)


@pytest.mark.parametrize(
    ("name", "topology", "chips", "hosts"),
    [
        ("v5p-16", "v5p:2x2x2", 8, 2),  # v5p names count TensorCores, two per chip
        ("v5p-128", "v5p:4x4x4", 64, 16),
        ("v4-32", "v4:2x2x4", 16, 4),
        ("v5e-16", "v5e:4x4", 16, 4),
        ("v5litepod-16", "v5e:4x4", 16, 4),
        ("v6e-8", "v6e:2x4", 8, 1),
        ("v6e-256", "v6e:16x16", 256, 64),
        ("v5p:2x2x2", "v5p:2x2x2", 8, 2),
        ("v5e:2x2", "v5e:2x2", 4, 1),
    ],
)
def test_tpu_names_map_to_topologies(name, topology, chips, hosts):
    t = parse_target(name)
    assert (t.platform, t.topology, t.num_devices, t.hosts) == ("tpu", topology, chips, hosts)


def test_slices_nodes_and_bad_names():
    assert parse_target("v5p-16", slices=2).num_devices == 16
    h = parse_target("h100:8", nodes=2)
    assert (h.platform, h.topology, h.num_devices, h.hosts) == ("gpu", "1x2x8", 16, 2)
    assert h.spec_path().endswith("gpu_specs/h100_sxm.txtpb")
    assert parse_target("a100-80g:4").chip.spec_file == "a100_sxm_80.txtpb"
    for bad, match in (
        ("v5p-12", "not a slice this table knows"),  # 6 chips: no such slice
        ("v5p-15", "not a slice"),
        ("v5e:2x2x2", "has two"),
        ("tpu9", "not a target"),
        ("h100:16", "1 to 8 GPUs"),
    ):
        with pytest.raises(ConfigError, match=match):
            parse_target(bad)
    with pytest.raises(ConfigError, match="--nodes is for GPU"):
        parse_target("v5e:2x2", nodes=2)


def test_hbm_and_gpu_budget(monkeypatch):
    message = (
        "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
        "temporaries (400.00G) exceeds available HBM (15.75G)."
    )
    assert hbm_from_message(message) == int(15.75 * GIB)
    assert hbm_from_message("Used 25.04G of 95.74G hbm. Exceeded hbm capacity") == int(95.74 * GIB)
    assert hbm_from_message("some other error") is None
    chip = parse_target("h100:8").chip
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    budget, how = gpu_budget_bytes(chip)
    assert budget == int(chip.hbm_bytes * 0.75) - GIB and "0.75" in how
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    assert gpu_budget_bytes(chip)[0] == int(chip.hbm_bytes * 0.9) - GIB


def _plan(capsys, config: str, topology: str, *sets: str) -> dict:
    args = ["memory", config, "--topology", topology, "--json"]
    for s in sets:
        args += ["--set", s]
    code = main(args)
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out)


def _check(plan: dict, names: tuple[str, ...], compiler: str) -> None:
    assert plan["compiler"].startswith(compiler)
    assert [p["name"] for p in plan["programs"]] == list(names)
    for p in plan["programs"]:
        assert p["peak_bytes"] > 0 and p["flops"] > 0 and p["roofline_s"] > 0, p
        assert p["peak_bytes"] >= p["temp_bytes"]
    assert plan["fits"] and 0 < plan["peak_bytes"] <= plan["device_bytes"]
    assert plan["peak_bytes"] == max(
        p["peak_bytes"] + p["resident_bytes"] for p in plan["programs"]
    )


GRPO_PROGRAMS = ("train_step", "scorer", "weight_reshard", "sampler_prefill_decode")
TINY_GRPO = ("rollout.max_slots=8",)


@needs_tpu
@pytest.mark.slow
@pytest.mark.parametrize(
    ("config", "programs"),
    [
        ("configs/sft_tiny.yaml", ("train_step", "scorer")),
        ("configs/dpo_tiny.yaml", ("train_step", "scorer")),
        ("configs/grpo_tiny.yaml", GRPO_PROGRAMS),
    ],
)
def test_tiny_runs_compile_for_v5e_with_splash(capsys, config, programs):
    sets = ("mesh.data=2", "mesh.fsdp=2", "model.attention_impl=auto")
    if "grpo" in config:
        sets += TINY_GRPO
    plan = _plan(capsys, config, "v5e:2x2", *sets)
    _check(plan, programs, "libtpu")
    assert plan["attention_impl"] == "splash"  # auto on a TPU target, compiled by libtpu
    assert plan["device_kind"] == "TPU v5 lite" and plan["device_bytes"] == int(15.75 * GIB)


@needs_tpu
@pytest.mark.slow
@pytest.mark.parametrize(
    ("config", "sets"),
    [
        ("configs/grpo_tiny.yaml", ("mesh.data=4", "mesh.fsdp=2", *TINY_GRPO)),
        ("configs/grpo_tiny_moe.yaml", ("mesh.data=4", "mesh.fsdp=2", *TINY_GRPO)),
    ],
)
def test_tiny_grpo_and_moe_compile_for_v5p(capsys, config, sets):
    plan = _plan(capsys, config, "v5p:2x2x2", *sets)
    _check(plan, GRPO_PROGRAMS, "libtpu")
    assert plan["device_kind"] == "TPU v5" and plan["devices"] == 8 and plan["hosts"] == 2
    assert plan["dcn_axes"] == []  # one slice (tests/test_pod_launch.py plans two)


Q72 = (
    "model.init={model_type: qwen2, vocab_size: 152064, hidden_size: 8192, num_hidden_layers: 80,"
    " num_attention_heads: 64, num_key_value_heads: 8, intermediate_size: 29568,"
    " tie_word_embeddings: false}"
)


@needs_tpu
@pytest.mark.slow
def test_a_72b_model_does_not_fit_v5e_2x2(capsys):
    sets = [Q72, "mesh.data=1", "mesh.fsdp=4", "model.scan_layers=true", "model.remat=block"]
    args = ["memory", "configs/sft_tiny.yaml", "--topology", "v5e:2x2"]
    for s in sets + ["schedule.max_tokens=512", "model.dtype=bfloat16"]:
        args += ["--set", s]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not fit" in err[0] and "GiB" in err[0], err
    assert "Traceback" not in err[0]


@needs_gpu
@pytest.mark.slow
def test_tiny_sft_compiles_for_h100_with_the_shipped_spec(capsys):
    plan = _plan(capsys, "configs/sft_tiny.yaml", "h100:8", "mesh.data=8")
    _check(plan, ("train_step", "scorer"), "XLA:GPU")
    assert plan["spec_file"].endswith("h100_sxm.txtpb")
    assert plan["attention_impl"] == "pallas_gpu"
