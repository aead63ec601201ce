"""TensorBoard events and W&B logs mirror metrics.jsonl: every scalar at every step, NaN kept,
resume without duplicated steps; a W&B project without the package is a config error."""

from __future__ import annotations

import math
import sys
import types

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util import tensor_util

from jaxrl.cli import main
from jaxrl.config import ConfigError, LoggingConfig, load_run_config
from jaxrl.train.run_io.metrics import MetricsWriter, read_metrics


def read_events(directory) -> dict[tuple[str, int], float]:
    """Every (tag, step) → value in a TensorBoard directory, via TensorBoard's own reader."""
    acc = EventAccumulator(str(directory), size_guidance={"tensors": 0})
    acc.Reload()
    out = {}
    for tag in acc.Tags()["tensors"]:
        for event in acc.Tensors(tag):
            assert (tag, event.step) not in out, f"{tag} logged twice at step {event.step}"
            out[tag, event.step] = tensor_util.make_ndarray(event.tensor_proto).item()
    return out


def expected_from_jsonl(path) -> dict[tuple[str, int], float | None]:
    """Every numeric (or null) entry of metrics.jsonl but ``step``; bools as 0/1."""
    out = {}
    for row in read_metrics(path):
        for key, value in row.items():
            if key != "step" and (value is None or isinstance(value, int | float)):
                out[key, row["step"]] = None if value is None else float(value)
    return out


def assert_events_match_jsonl(output_dir) -> None:
    events = read_events(output_dir / "tensorboard")
    expected = expected_from_jsonl(output_dir / "metrics.jsonl")
    numbers = {k for k, v in expected.items() if v is not None}
    assert numbers <= set(events) <= set(expected), set(events) ^ set(expected)
    for key, value in expected.items():
        if value is None:  # JSON null: NaN/±inf in TensorBoard, or None (not logged)
            assert key not in events or not math.isfinite(events[key]), key
        else:
            assert events[key] == value, key  # float64 both ways: exact


ROWS = [
    {"step": 1, "loss": 0.5, "update_skipped": False, "num_tokens": 123456789, "note": "x"},
    {"step": 2, "loss": float("nan"), "grad_norm": float("inf"), "update_skipped": True},
    {"step": 3, "loss": 0.1 + 0.2, "eval/accuracy": 0.25, "hist": [1, 2], "start": None},
]


def test_rows_become_events_nan_kept_non_scalars_left_out(tmp_path):
    writer = MetricsWriter(tmp_path, tensorboard=True)
    for row in ROWS:
        writer.write(row)
    writer.close()
    events = read_events(tmp_path / "tensorboard")
    assert events[("loss", 1)] == 0.5 and events[("loss", 3)] == 0.1 + 0.2  # not float32
    assert events[("num_tokens", 1)] == 123456789 and events[("update_skipped", 2)] == 1.0
    assert math.isnan(events[("loss", 2)]) and events[("grad_norm", 2)] == math.inf
    assert not {k for k, _ in events} & {"note", "hist", "start", "step"}
    assert_events_match_jsonl(tmp_path)


def test_resume_rewrites_the_events_like_metrics_jsonl(tmp_path):
    writer = MetricsWriter(tmp_path, tensorboard=True)
    for step in range(1, 6):
        writer.write({"step": step, "loss": float(step)})
    writer.close()  # "crashed" after step 5; the newest checkpoint is step 3
    writer = MetricsWriter(tmp_path, resume_step=3, tensorboard=True)
    for step in range(4, 7):
        writer.write({"step": step, "loss": 10.0 * step})
    writer.close()
    events = read_events(tmp_path / "tensorboard")  # raises if a step were there twice
    assert events == {("loss", s): (float(s) if s <= 3 else 10.0 * s) for s in range(1, 7)}
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 1
    fresh = MetricsWriter(tmp_path, tensorboard=True)  # a fresh run starts both from nothing
    fresh.close()
    assert read_events(tmp_path / "tensorboard") == {}


def test_only_the_writing_process_logs(tmp_path):
    MetricsWriter(tmp_path, enabled=False, tensorboard=True).write(ROWS[0])
    assert not (tmp_path / "tensorboard").exists() and not (tmp_path / "metrics.jsonl").exists()


def test_wandb_without_the_package_is_a_config_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as when it is not installed
    with pytest.raises(ConfigError, match=r"logging.wandb='proj' needs the wandb package: pip"):
        LoggingConfig(wandb="proj")
    with pytest.raises(ConfigError, match="needs the wandb package"):
        load_run_config(None, ["logging.wandb=proj"])
    with pytest.raises(ConfigError, match="name a W&B project"):
        LoggingConfig(wandb=" ")


def test_wandb_gets_the_same_rows(tmp_path, monkeypatch):
    calls = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls.append(("init", kw))
    fake.log = lambda data, step: calls.append(("log", data, step))
    fake.finish = lambda: calls.append(("finish",))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    assert LoggingConfig(wandb="proj").wandb == "proj"
    writer = MetricsWriter(tmp_path, tensorboard=False, wandb="proj", run_config={"seed": 3})
    writer.write(ROWS[0])
    writer.write(ROWS[1])
    writer.close()
    assert calls[0] == ("init", {"project": "proj", "dir": str(tmp_path), "config": {"seed": 3}})
    assert calls[1] == ("log", {"loss": 0.5, "update_skipped": 0.0, "num_tokens": 123456789.0}, 1)
    assert calls[2][2] == 2 and math.isnan(calls[2][1]["loss"]) and calls[2][1]["grad_norm"] > 1e308
    assert calls[3:] == [("finish",)]
    calls.clear()
    MetricsWriter(tmp_path, resume_step=1, wandb="proj").close()  # a new run replays step 1
    assert [c[0] for c in calls] == ["init", "log", "finish"] and calls[1][2] == 1


@pytest.mark.slow
def test_sft_cli_run_writes_events_equal_to_metrics_jsonl(tmp_path):
    out = tmp_path / "sft"
    settings = [
        f"output_dir={out}",
        "max_steps=3",
        "logging.progress=false",
        "logging.eval_every=2",  # eval rows (eval/accuracy) at steps 2 and 3
        "task.train_size=64",
        "task.eval_size=8",
        "sft.per_device_train_batch_size=16",
        "model.init={hidden_size: 32, num_hidden_layers: 1, num_attention_heads: 2, "
        "num_key_value_heads: 1, intermediate_size: 64}",
        "optimizer.warmup_steps=0",
    ]
    assert (
        main(["train", "configs/sft_tiny.yaml", *[a for s in settings for a in ("--set", s)]]) == 0
    )
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3] and "eval/accuracy" in rows[-1]
    assert_events_match_jsonl(out)
    assert ("eval/accuracy", 2) in read_events(out / "tensorboard")
