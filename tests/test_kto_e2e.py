"""KTO end to end (algorithm: kto): data rows, config errors, and the step the same on every
layout, z₀ included (docs/losses.md)."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from jaxrl.config import ConfigError, load_run_config
from jaxrl.data.datasets import DataError, rows_dataset
from jaxrl.data.tasks import ArithmeticTask
from jaxrl.data.unpaired import kto_examples, task_rows
from jaxrl.runtime.mesh import to_host, use_devices
from jaxrl.trainers.check import StepOutcome, compare
from jaxrl.trainers.kto import KTOTrainer

SMALL = [
    "warm_start.steps=0",
    "optimizer.learning_rate=1e-3",
    "optimizer.warmup_steps=0",
    "optimizer.eps=1e-3",  # Adam's ε: see tests/test_orpo.py
    "task.train_size=64",
    "task.eval_size=8",
    "model.init={hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 4, "
    "num_key_value_heads: 2, intermediate_size: 64}",
]
LAYOUTS = {  # 16 examples per step in every layout
    "dp1_1mb": (["mesh.data=1", "kto.per_device_train_batch_size=16",
                 "schedule.max_tokens=512"], 1),
    "dp1_4mb": (["mesh.data=1", "kto.per_device_train_batch_size=4",
                 "kto.gradient_accumulation_steps=4", "schedule.max_tokens=48"], 1),
    "dp8": (["mesh.data=8", "kto.per_device_train_batch_size=2", "schedule.max_tokens=32"], 8),
    "d2f2t2": (["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2",
                "kto.per_device_train_batch_size=4", "schedule.max_tokens=48"], 8),
}  # fmt: skip


def test_task_rows_are_unpaired_and_labelled():
    pairs = ArithmeticTask().rows("dpo", 6)
    rows = task_rows(pairs)
    assert [r["label"] for r in rows] == [True, False] * 3
    assert [r["completion"] for r in rows[::2]] == [p["chosen"] for p in pairs[::2]]
    assert [r["completion"] for r in rows[1::2]] == [p["rejected"] for p in pairs[1::2]]
    assert len({r["prompt"] for r in rows}) == 6


def test_bad_rows_and_batches_are_clear_errors(tmp_path):
    tok = ArithmeticTask().tokenizer()
    bad = rows_dataset([{"prompt": "1+1=", "completion": "2", "label": "yes"}], "sft", source="x")
    with pytest.raises(DataError, match="'label' must be true"):
        kto_examples(bad, tok, max_length=16, max_prompt_length=None)
    missing = rows_dataset([{"prompt": "1+1=", "completion": "2"}], "sft", source="x")
    with pytest.raises(DataError, match="needs prompt, completion and label"):
        kto_examples(missing, tok, max_length=16, max_prompt_length=None)
    with pytest.raises(ConfigError, match="kto.loss_type"):
        load_run_config("configs/kto_tiny.yaml", ["kto.loss_type=sigmoid"])
    cfg = load_run_config(
        "configs/kto_tiny.yaml",
        [*SMALL, "kto.per_device_train_batch_size=1", f"output_dir={tmp_path}"],
    )
    with use_devices(jax.devices()[:1]), pytest.raises(ConfigError, match="at least 2"):
        KTOTrainer(cfg)


def _step(name, tmp_path):
    """One step of LAYOUTS[name] against a reference that is not the policy (the starting
    weights × 1.5), so z₀ and the rewards are not 0; returns the outcome and z₀."""
    sets, devices = LAYOUTS[name]
    cfg = load_run_config("configs/kto_tiny.yaml", [*SMALL, *sets, f"output_dir={tmp_path / name}"])
    with use_devices(jax.devices()[:devices]):
        trainer = KTOTrainer(cfg)
        trainer.reference = jax.tree.map(lambda x: x * 1.5, trainer.reference)
        trainer.build_references()
        batch = trainer.next_batch()
        z0 = float(batch.arrays["kto_z0"].reshape(-1)[0])
        row = trainer.session.train_on(batch)
        params = [
            np.asarray(x, np.float64)
            for x in jax.tree.leaves(to_host(trainer.session.state.params))
        ]  # noqa: E501
    return StepOutcome(row, params), z0


@pytest.mark.slow
def test_kto_step_and_z0_are_the_same_in_every_layout(tmp_path):
    out = {name: _step(name, tmp_path) for name in LAYOUTS}
    ref, z0 = out["dp1_1mb"]
    assert z0 > 0 and ref.row["kl"] == pytest.approx(z0)
    assert ref.row["num_micro_batches"] == 1 and out["dp1_4mb"][0].row["num_micro_batches"] >= 4
    assert ref.row["denominator"] == 16
    for name, (outcome, z) in out.items():
        if name == "d2f2t2":  # tensor parallel splits the forward's sums: fp32 rounding
            assert z == pytest.approx(z0, rel=1e-5), name  # measured 2.1e-6
        else:  # data parallel and micro-batching: the same bits (layout-free scoring)
            assert z == z0, name
        diffs = compare(outcome, ref)
        assert max(diffs.values()) <= 1e-6, (name, diffs)


@pytest.mark.slow
def test_kto_runs_from_the_cli_and_writes_the_dpo_metric_names(tmp_path):
    from jaxrl.cli import main

    out = tmp_path / "run"
    args = ["train", "configs/kto_tiny.yaml", "--set", f"output_dir={out}"]
    for s in [*SMALL, "mesh.data=8", "kto.per_device_train_batch_size=2", "max_steps=2",
              "logging.eval_every=2", "logging.progress=false"]:  # fmt: skip
        args += ["--set", s]
    assert main(args) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[0] == {  # policy = reference: no margin is past the tolerance
        "step": 0,
        "eval/accuracy": 0.0,
        "eval/accuracy_desirable": 0.0,
        "eval/accuracy_undesirable": 0.0,
    }
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for key in ("loss", "grad_norm", "kl", "rewards/chosen", "rewards/rejected"):
        assert key in steps[0]
    assert steps[0]["loss"] == pytest.approx(0.5, abs=1e-6)  # policy = reference: σ(0) = ½
    assert "eval/accuracy" in steps[-1]
