"""``jaxrl check``: one optimizer step in two layouts (README, docs/algorithms/accumulation.md).
It passes on the shipped tiny configs and fails, naming the loss, on an objective that divides
by the micro-batch count."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from jaxrl.cli import main
from jaxrl.config import load_run_config
from jaxrl.losses.normalize import LossTerms
from jaxrl.trainers.check import TOLERANCE, layout_overrides

SMALL = [
    "mesh.data=8",
    "task.train_size=64",
    "task.eval_size=8",
    "sft.per_device_train_batch_size=2",
]


def _check(config, *sets):
    args = ["check", config]
    for s in sets:
        args += ["--set", s]
    return main(args)


def test_layouts_regroup_the_ranks_and_halve_the_budget():
    cfg = load_run_config("configs/sft_tiny.yaml", ["mesh.data=-1"])
    a, b, line_a, line_b = layout_overrides(cfg, 8)
    assert "mesh.data=8" in a and "mesh.fsdp=1" in a
    assert "mesh.data=1" in b and "mesh.fsdp=8" in b and "schedule.max_tokens=128" in b
    for sets in (a, b):  # the step starts where a train run's first step would, and moves
        assert "optimizer.warmup_steps=0" in sets and "optimizer.eps=0.001" in sets
        assert not any(s.startswith("warm_start.") for s in sets)  # SFT has no warm start
    assert line_a != line_b
    assert max(TOLERANCE.values()) <= 1e-5
    grpo = layout_overrides(load_run_config("configs/grpo_tiny.yaml", ["mesh.data=-1"]), 8)
    assert all("warm_start.steps=0" in sets for sets in grpo[:2])


@pytest.mark.slow
@pytest.mark.parametrize(
    "config,sets",
    [
        ("configs/sft_tiny.yaml", SMALL),
        ("configs/dpo_tiny.yaml", [*SMALL, "dpo.per_device_train_batch_size=4"]),
        (  # layout A generates; both layouts train on that generation
            "configs/grpo_tiny.yaml",
            [*SMALL, "grpo.per_device_train_batch_size=8", "grpo.num_generations=4"],
        ),
        (  # the same generation; each layout's critic values it, both steps compared
            "configs/ppo_tiny.yaml",
            [*SMALL, "ppo.actor.per_device_train_batch_size=8", "ppo.actor.num_generations=4"],
        ),
    ],
)
def test_shipped_tiny_configs_pass(config, sets, capsys):
    assert _check(config, *sets) == 0
    out = capsys.readouterr().out
    names = ("loss", "grad_norm", "params")
    if "ppo" in config:
        names += ("value_loss", "critic/grad_norm")
    for name in names:
        assert any(line.startswith(name) and line.endswith("ok") for line in out.splitlines())
    assert "verdict: PASS" in out


@pytest.mark.slow
def test_a_per_micro_batch_mean_fails_naming_the_loss(monkeypatch, capsys):
    """The bug the engine exists to avoid: each micro-batch divides by its own count
    (denominator 1 per micro-batch, so the step divides by the micro-batch count)."""
    import jaxrl.trainers.sft as sft_trainer

    exact = sft_trainer.sft_objective

    def per_micro_batch_mean(config, **kw):
        objective = exact(config, **kw)

        def biased(model, mb):
            t = objective(model, mb)
            mean = t.numerator / jnp.maximum(t.denominator, 1.0)
            return LossTerms(mean, jnp.ones_like(t.denominator), t.metrics)

        return biased

    monkeypatch.setattr(sft_trainer, "sft_objective", per_micro_batch_mean)
    assert _check("configs/sft_tiny.yaml", *SMALL) == 1
    out = capsys.readouterr().out
    assert "verdict: FAIL: loss" in out
    assert any(line.startswith("loss") and line.endswith("DIFFERENT") for line in out.splitlines())
