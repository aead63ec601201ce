"""The accelerator check (benchmarks/device_check.sh) cannot rot before a GPU is available: its
``--cpu-smoke`` mode runs every part (train step with the kernel and with xla, peak memory
against ``jaxrl memory``, engine vs static sampler vs HF decode, a GRPO step of the shipped
config, the ZeRO-3 step on 2 host devices) on tiny shapes on CPU, through the same driver and
workers as the GPU run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import device_check  # noqa: E402


def test_table_of_a_gpu_run_reads_mfu_memory_and_na():
    """The table a one-GPU run prints, from a recorded result: MFU against the H100's peak, the
    peak-memory ratio, decode against HF, the GRPO step, ZeRO-3 as n/a."""
    train = {
        "s_per_step": 0.5, "tokens_per_step": 32768, "tflops": 600.0, "peak_bf16": 989.4e12,
        "mfu": 600e12 / 989.4e12, "device_kind": "NVIDIA H100 80GB HBM3", "peak_bytes": 30 * 2**30,
    }  # fmt: skip
    res = {
        "train": {"pallas_gpu": train, "xla": {**train, "s_per_step": 0.75}},
        "memory": {"xla": {"total_bytes": 25 * 2**30, "platform": "cpu"}},
        "decode": {
            "dtype": "bfloat16",
            "torch_device": "cuda",
            "methods": {
                "engine": {"tok_s": 9000.0},
                "static sampler": {"tok_s": 3000.0},
                "HF generate": {"tok_s": 3000.0},
            },
        },  # fmt: skip
        "grpo": {"label": "random init", "s_per_step": 2.0, "first_step_s": 60.0},
        "zero3": {"na": "1 gpu device: mesh.fsdp > 1 needs more than one"},
    }
    text = "\n".join(device_check.table(res, device_check.PROFILES["full"]))
    assert "MFU 60.6%" in text
    assert "1.50x faster (pallas_gpu)" in text
    assert "30.00 GiB" in text and "25.00 GiB | 1.20 (measured / planned)" in text
    assert "3.00x HF" in text
    assert "30.0x" in text  # first GRPO step / steady step
    assert "n/a: 1 gpu device" in text


@pytest.mark.slow
def test_device_check_cpu_smoke(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("XLA_FLAGS", None)  # the driver sets each part's host devices itself
    proc = subprocess.run(
        ["bash", str(ROOT / "benchmarks/device_check.sh"), "--cpu-smoke", "--out", str(tmp_path)],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = (tmp_path / "device_check.md").read_text()
    for check in ("train step", "peak memory", "decode", "GRPO step", "ZeRO-3 step"):
        assert f"| {check} |" in table, table
    assert "attention_impl=flash" in table and "attention_impl=xla" in table
    assert "fsdp=2" in table  # the ZeRO-3 step ran on 2 host devices
    assert "random init" in table  # the smoke never reads a real checkpoint
    assert "MFU = (6 N tokens" in table
    assert (tmp_path / "device_check.json").is_file() and (tmp_path / "device_check.log").is_file()


def test_decode_matmul_bound_runs_on_tiny_sizes():
    """benchmarks/decode_matmul_bound.py (the matmul cost by rows behind the long tail's bound)
    runs through: the per-row table for both dtypes, the fit, the rows-riding-along table."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/decode_matmul_bound.py"), "--pairs", "2",
         "--rows", "16", "32", "--riding", "16", "--repeat", "1", "--read-mb", "8"],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "read bandwidth (sum of 8 MB)" in out
    assert out.count("fit over M >= 16: time = ") == 2  # bfloat16 and float32
    assert "| 16 | " in out and "| 32 | " in out
    assert "16 + P rows in one call" in out


def test_long_tail_replay_follows_the_engines_schedule():
    """``long_tail_bound.replay`` predicts the decode steps the engine runs (slots refilled in
    request order at the start of every step), and charges each step the cost of its slots, or
    with ``compact`` of the smallest listed size that holds the live ones."""
    import flax.nnx as nnx
    import jax
    import numpy as np
    from long_tail_bound import replay

    from jaxrl.generate.sampler import Sampler, SamplingParams
    from jaxrl.models.model_config import ModelConfig
    from jaxrl.models.transformer import Transformer

    # 2 slots, limits 3 1 1 2: r0 r1 | r0 r2 | r0 r3 | r3 -> 4 steps of 2, 2, 2, 1 live slots
    assert replay([3, 1, 1, 2], 2, lambda s: 1.0) == (4, 4.0)
    assert replay([3, 1, 1, 2], 2, lambda s: float(s), compact=[1, 2]) == (4, 7.0)
    assert replay([5, 1, 1], 8, lambda s: 1.0) == (5, 5.0)  # more slots than requests
    with pytest.raises(ValueError, match="limits must be >= 1"):
        replay([2, 0], 2, lambda s: 1.0)

    config = ModelConfig.tiny(256, num_hidden_layers=1, hidden_size=32, intermediate_size=64)
    model = Transformer(config, rngs=nnx.Rngs(0))
    eos = 1
    model.embedding[...] = model.embedding[...].at[eos].set(0.0)  # logit 0: never the argmax
    rng = np.random.default_rng(0)
    limits = np.clip(np.exp(rng.normal(np.log(4), 1.0, 24)).round(), 1, 24).astype(np.int32)
    prompts = [rng.integers(2, 256, size=n).tolist() for n in rng.integers(1, 9, size=24)]
    for slots in (3, 5):
        sampler = Sampler(config, max_new_tokens=24, eos_id=eos, pad_id=0, max_slots=slots)
        sampler.load_params(model)
        res = sampler.generate(
            prompts, jax.random.key(0), SamplingParams(temperature=0.0), max_tokens=limits
        )
        assert (res.lengths == limits).all()  # no request stopped early at eos
        assert res.num_steps == replay(limits, slots, lambda s: 1.0)[0]
