"""Compile once per shape, and keep it: ``model.dtype: auto``, the persistent compilation cache
(``compile_cache``), and the ``compiles`` metric with its new-bucket lines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxrl.config import ConfigError, load_run_config
from jaxrl.runtime.compile_cache import default_cache_dir
from jaxrl.train.build import model_config
from jaxrl.train.precision import auto_compute_dtype, auto_dtype_note
from jaxrl.trainers.counters import CompileWatch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("dtype", "platform", "expected"),
    [
        ("auto", "cpu", "float32"),  # XLA emulates bf16 arithmetic on the CPU
        ("auto", "gpu", "bfloat16"),
        ("auto", "tpu", "bfloat16"),
        ("bfloat16", "cpu", "bfloat16"),  # a pinned dtype is kept
        ("float32", "tpu", "float32"),
        (None, "gpu", None),  # None: param_dtype, resolved by ModelConfig
    ],
)
def test_auto_dtype_follows_the_backend(dtype, platform, expected):
    assert auto_compute_dtype(dtype, platform) == expected


def test_auto_dtype_resolves_in_the_model_config_and_says_why():
    cfg = load_run_config("configs/sft_tiny.yaml", ["model.dtype=auto"])
    assert cfg.model.dtype == "auto"  # the config keeps what was given
    assert model_config(cfg.model, 64).dtype == "float32"  # this backend: the CPU
    assert model_config(cfg.model, 64, platform="gpu").dtype == "bfloat16"
    assert "float32" in auto_dtype_note("cpu") and "emulated" in auto_dtype_note("cpu")


def test_the_shipped_real_model_configs_use_auto():
    for name in ("sft_qwen", "dpo_qwen", "grpo_gsm8k_qwen", "grpo_gsm8k_qwen_lora"):
        cfg = load_run_config(f"configs/{name}.yaml", ["model.path=unused"])
        assert cfg.model.dtype == "auto", name


def test_memory_plans_auto_as_an_accelerator_runs_it():
    from jaxrl.train.run_io.memory import plan_memory

    sets = ["model.dtype=auto", "mesh.data=1"]
    plan = plan_memory(load_run_config("configs/sft_tiny.yaml", sets))
    bf16 = plan_memory(
        load_run_config("configs/sft_tiny.yaml", [*sets[1:], "model.dtype=bfloat16"])
    )
    assert plan["compute_copy_bytes"] == bf16["compute_copy_bytes"]
    assert any("model.dtype=auto" in note for note in plan["notes"])


@pytest.mark.parametrize("bad", ["''", "'  '"])
def test_compile_cache_rejects_an_empty_path(bad):
    with pytest.raises(ConfigError, match="compile_cache"):
        load_run_config("configs/sft_tiny.yaml", [f"compile_cache={bad}"])


def test_default_cache_dir_honours_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXRL_COMPILE_CACHE", str(tmp_path / "x"))
    assert default_cache_dir() == tmp_path / "x"
    monkeypatch.setenv("JAXRL_COMPILE_CACHE", "off")
    assert default_cache_dir() is None
    monkeypatch.delenv("JAXRL_COMPILE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "jaxrl" / "xla"


class _Program:
    def __init__(self):
        self.compiles, self.last_compile = 0, ""

    def trace(self, shapes: str) -> None:
        self.compiles += 1
        self.last_compile = shapes


def test_compile_watch_sums_programs_and_names_a_new_bucket_once():
    step, sampler = _Program(), _Program()
    watch = CompileWatch()
    watch.add("train step", step)
    watch.add("sampler", sampler)
    watch.add("scorer", sampler)  # the same program under another name counts once
    step.trace("rows [R, M, T] = [1, 4, 384]")
    sampler.trace("8 requests")
    assert watch.total == 2
    assert watch.news(1) == []  # compiling is what a first step does
    assert watch.news(2) == []  # a steady step compiles nothing
    step.trace("rows [R, M, T] = [1, 4, 512]")
    (line,) = watch.news(3)
    assert "step 3" in line and "train step" in line and "[1, 4, 512]" in line
    assert watch.news(4) == [] and watch.total == 3


def test_compile_cache_false_turns_the_cache_off_and_a_path_turns_it_on(tmp_path):
    import jax

    from jaxrl.runtime.compile_cache import enable_compile_cache

    before = jax.config.jax_compilation_cache_dir
    try:
        assert enable_compile_cache(False) is None
        assert not jax.config.jax_enable_compilation_cache
        assert enable_compile_cache(str(tmp_path)) == tmp_path.resolve()
        assert jax.config.jax_enable_compilation_cache
        assert jax.config.jax_compilation_cache_dir == str(tmp_path.resolve())
    finally:
        enable_compile_cache(before or False)  # the suite's own cache (tests/conftest.py)


def test_remembered_shapes_live_beside_the_cache_and_not_without_it(tmp_path):
    import jax

    from jaxrl.runtime import compile_cache as cc

    before = jax.config.jax_compilation_cache_dir
    try:
        cc.enable_compile_cache(False)
        cc.remember("family", [[1]])
        assert cc.remembered("family") == []  # the cache off: nothing kept, nothing read
        cc.enable_compile_cache(str(tmp_path))
        assert cc.remembered("family") == []
        entries = [[["tokens", [1, 2, 64 * i], "int32"]] for i in range(cc.MAX_REMEMBERED + 2)]
        cc.remember("family", entries)
        assert cc.remembered("family") == entries[-cc.MAX_REMEMBERED :]  # the most recent
        assert [p.name for p in (tmp_path / cc.SHAPES_DIR).iterdir()] == ["family.json"]
        (tmp_path / cc.SHAPES_DIR / "family.json").write_text("{not json")
        assert cc.remembered("family") == []  # unreadable: as if none
    finally:
        cc.enable_compile_cache(before or False)  # the suite's own cache (tests/conftest.py)


def _train(config: str, out: Path, cache: str, *sets: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k not in ("JAXRL_COMPILE_CACHE", "XLA_FLAGS")}
    cmd = [sys.executable, "-m", "jaxrl.cli", "train", config, "--set", f"output_dir={out}"]
    for s in ("logging.progress=false", f"compile_cache={cache}", *sets):
        cmd += ["--set", s]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # two fresh processes compile a GRPO run
def test_a_second_run_reads_its_programs_from_the_cache_and_compiles_no_more(tmp_path):
    sets = (
        "max_steps=3",
        "warm_start.steps=0",
        "logging.eval_every=0",
        "task.eval_size=8",
        "model.init={hidden_size: 32, num_hidden_layers: 1, num_attention_heads: 2, "
        "num_key_value_heads: 1, intermediate_size: 64}",
    )
    cache = tmp_path / "xla"
    first = _train("configs/grpo_tiny.yaml", tmp_path / "a", str(cache), *sets)
    second = _train("configs/grpo_tiny.yaml", tmp_path / "b", str(cache), *sets)
    steps = [r for r in first if "compiles" in r]
    assert steps[0]["compile_cache_hits"] == 0 and any(cache.iterdir())
    assert [r["compiles"] for r in steps] == [steps[0]["compiles"]] * len(steps)  # steady
    again = [r for r in second if "compiles" in r]
    assert again[0]["compile_cache_hits"] >= 3  # train step, sampler, scorer
    # the train step's batch shapes are remembered beside the cache (the second run compiled
    # them ahead, on the background thread, while it started)
    (family,) = (cache / "jaxrl-shapes").glob("train-step-grpo-*.json")
    tokens = [dict((name, shape) for name, shape, _ in sig)["tokens"] for sig in
              json.loads(family.read_text())]  # fmt: skip
    assert sorted({shape[-1] for shape in tokens}) == sorted({r["row_len"] for r in steps})
