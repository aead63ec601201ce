"""The ``jaxrl`` command line: subcommands wire through, config errors exit 2 with the fix."""

from __future__ import annotations

import numpy as np

from jaxrl.cli import _ensure_host_devices, main


def test_schedule_subcommand_prints_both_modes_and_plots(tmp_path, capsys):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(str(n) for n in np.random.default_rng(0).integers(50, 900, 64)))
    png = tmp_path / "plan.png"
    assert main(
        [
            "schedule",
            "--lengths",
            str(lengths),
            "--dp",
            "4",
            "--max-tokens",
            "1024",
            "--plot",
            str(png),
        ]
    ) in (0, None)
    out = capsys.readouterr().out
    assert "slime" in out and "default" in out
    assert png.stat().st_size > 1000


def test_train_config_error_exits_2_naming_the_field(tmp_path, capsys):
    code = main(
        [
            "train",
            "configs/sft_tiny.yaml",
            "--set",
            "schedule.docs_per_step=-3",
            "--set",
            f"output_dir={tmp_path}",
        ]
    )
    assert code == 2
    assert "schedule.docs_per_step=-3" in capsys.readouterr().err


def test_host_device_flag_is_set_or_raised(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_foo=1 --xla_force_host_platform_device_count=2")
    _ensure_host_devices(8)
    import os

    flags = os.environ["XLA_FLAGS"]
    assert "--xla_force_host_platform_device_count=8" in flags and "--xla_cpu_foo=1" in flags
    _ensure_host_devices(4)  # never lowers an existing larger count
    assert "--xla_force_host_platform_device_count=8" in os.environ["XLA_FLAGS"]
