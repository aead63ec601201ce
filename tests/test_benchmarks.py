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
