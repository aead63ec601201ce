"""The ``jaxrl`` command line: subcommands wire through, config errors exit 2 with the fix."""

from __future__ import annotations

import numpy as np
import pytest

from jaxrl.cli import main
from jaxrl.config import DistributedConfig, MeshConfig
from jaxrl.runtime.launch import ensure_host_devices, host_device_count


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


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("100\n40000\n200\n", "1 sample(s) exceed --max-tokens=1024 (sample 1: 40000 tokens)"),
        ("100\nabc\n", "lengths.txt:2: 'abc' is not an integer length"),
    ],
)
def test_schedule_bad_lengths_exit_2_in_one_line(tmp_path, capsys, content, message):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text(content)
    args = ["schedule", "--lengths", str(lengths), "--dp", "2", "--max-tokens", "1024"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert "%" not in err[0]


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
    ensure_host_devices(8)
    import os

    flags = os.environ["XLA_FLAGS"]
    assert "--xla_force_host_platform_device_count=8" in flags and "--xla_cpu_foo=1" in flags
    ensure_host_devices(4)  # never lowers an existing larger count
    assert "--xla_force_host_platform_device_count=8" in os.environ["XLA_FLAGS"]


def test_host_device_count_follows_the_mesh_and_the_processes():
    one = DistributedConfig()
    assert host_device_count(MeshConfig(data=2, fsdp=2, tensor=2), one) == 8
    assert host_device_count(MeshConfig(data=-1, fsdp=4), one) == 4  # -1 counts as 1 here
    two = DistributedConfig(coordinator_address="localhost:1", num_processes=2, process_id=1)
    assert host_device_count(MeshConfig(data=8), two) == 4


def test_a_mesh_that_does_not_match_the_devices_is_a_config_error(tmp_path, capsys):
    import jax

    from jaxrl.runtime.mesh import use_devices

    with use_devices(jax.devices()):  # strict, as outside the test suite's device pool
        code = main(["train", "configs/sft_tiny.yaml", "--set", f"output_dir={tmp_path}"])
    err = capsys.readouterr().err
    assert code == 2  # the test process has 8 devices; sft_tiny asks for mesh.data=1
    assert "uses 1 devices but 8 devices are visible" in err and "mesh.data" in err


def test_a_missing_model_directory_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("JAXRL_DEBUG", raising=False)
    args = ["train", "configs/sft_tiny.yaml", "--set", f"output_dir={tmp_path}"]
    args += ["--set", f"model.path={tmp_path / 'nope'}"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "nope" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 2  # the error and the --debug hint
    monkeypatch.setenv("JAXRL_DEBUG", "1")
    with pytest.raises(FileNotFoundError):
        main(args)


RESUME_SFT = [
    "logging.progress=false",
    "model.init={hidden_size: 32, num_hidden_layers: 1, num_attention_heads: 2, "
    "num_key_value_heads: 1, intermediate_size: 64}",
    "task.train_size=64",
    "task.eval_size=8",
    "sft.per_device_train_batch_size=16",
    "logging.eval_every=0",
    "checkpoint.every=1",
]


def _train(tmp_path, capsys, *sets: str) -> str:
    args = ["train", "configs/sft_tiny.yaml"]
    for s in [*RESUME_SFT, f"output_dir={tmp_path}", *sets]:
        args += ["--set", s]
    assert main(args) == 0
    return capsys.readouterr().err


@pytest.mark.slow
def test_resume_onto_another_layout_says_what_changed(tmp_path, capsys):
    assert "mesh/schedule" not in _train(tmp_path, capsys, "max_steps=1")
    same_batch = ["mesh.data=2", "sft.per_device_train_batch_size=8"]  # 16 documents a step
    err = _train(tmp_path, capsys, "max_steps=2", *same_batch, "schedule.max_tokens=64")
    assert "resumed from step 1" in err
    line = next(x for x in err.splitlines() if "mesh/schedule settings" in x)
    assert "resuming at step 1 with other mesh/schedule settings than the previous run" in line
    assert "mesh.data: 1 -> 2, schedule.max_tokens: 256 -> 64. " in line
    assert "mesh.data and schedule.max_tokens only decide how each step's documents" in line
    assert "the resumed steps make the updates the previous layout would have made" in line
    assert "docs_per_step" not in line  # the batch is per rank in every section, SFT's too:
    assert "But sft.per_device_train_batch_size counts per data-parallel rank" in line
    err = _train(tmp_path, capsys, "max_steps=3", *same_batch, "schedule.max_tokens=64")
    assert "resumed from step 2" in err and "mesh/schedule" not in err  # same as last run


def test_layout_change_line_names_batch_changes():
    from jaxrl.trainers.layout_change import layout_change_line

    old = {"algorithm": "grpo", "mesh": {"data": 1}, "schedule": {"docs_per_step": 0}}
    new = {"algorithm": "grpo", "mesh": {"data": 4}, "schedule": {"docs_per_step": 64}}
    line = layout_change_line(old, new, step=7, ranks=4)
    assert "mesh.data: 1 -> 4, schedule.docs_per_step: 0 -> 64" in line
    assert "mesh.data only decides how" in line
    assert "But grpo.per_device_train_batch_size counts per data-parallel rank" in line
    assert "now 4" in line and "docs_per_step sets the documents per step: from here on" in line
    assert layout_change_line(old, old, step=7, ranks=1) == ""
    assert layout_change_line(None, new, step=7, ranks=4) == ""


def test_help_is_plain_text_and_version_is_the_package_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert "``" not in text and "--version" in text
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.strip() == f"jaxrl {version('jaxrl')}"
    with pytest.raises(SystemExit):
        main(["schedule", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "``" not in text
    assert "--mode {slime,default,both} slime: first-fit packing" in text
    assert "slime mode can have the lower one" in text
    assert "--micro-batch-group MICRO_BATCH_GROUP each rank's micro-batch count" in text


def test_help_names_every_algorithm_and_command(capsys):
    """``jaxrl --help`` names every ``algorithm:`` the config accepts and every subcommand
    (in its description, not only in the usage line); ``jaxrl train --help`` names the
    algorithms too, orpo included (a dpo.loss_type)."""
    import dataclasses
    import re
    import typing

    from jaxrl.config import RunConfig

    field = next(f for f in dataclasses.fields(RunConfig) if f.name == "algorithm")
    algorithms = typing.get_args(typing.get_type_hints(RunConfig)[field.name])
    assert {"sft", "dpo", "kto", "grpo", "ppo"} <= set(algorithms)
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    commands = re.search(r"\{([a-z,]+)\}", text).group(1).split(",")
    assert {"train", "check", "memory", "schedule"} <= set(commands)
    description = " ".join(text.split("positional arguments")[0].split("\n")[1:])
    missing = [
        w for w in (*algorithms, *commands, "orpo") if not re.search(rf"\b{w}\b", description)
    ]
    assert not missing, f"jaxrl --help does not describe {missing}"
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    train = capsys.readouterr().out
    assert all(re.search(rf"\b{a}\b", train) for a in (*algorithms, "orpo")), train


@pytest.mark.parametrize("dp", [2, 5, 64])
def test_schedule_plot_has_integer_rank_ticks_and_titles_that_fit(dp):
    from jaxrl.data.batching.schedule_report import compare_schedules, schedule_figure

    lengths = np.random.default_rng(0).integers(1, 513, 8 * dp)
    fig = schedule_figure(compare_schedules(lengths, dp=dp, max_tokens=512), lengths)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    width = fig.bbox.width
    for ax in fig.axes:
        box = ax.title.get_window_extent(renderer)
        assert 0 <= box.x0 and box.x1 <= width, (ax.title.get_text(), box, width)
        ticks = [t for t in ax.get_xticks() if -0.5 <= t <= dp - 0.5]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks
        if dp <= 32:
            assert [int(t) for t in ticks] == list(range(dp))


@pytest.mark.parametrize(
    "sets, message",
    [
        (["grpo.reward_funcs=[no_such_pkg.mod:f]"],
         "config error: grpo.reward_funcs[0]='no_such_pkg.mod:f' is invalid: cannot import module"),
        (["mesh.data=-1", "grpo.per_device_train_batch_size=1", "grpo.num_generations=16"],
         "config error: grpo.generation_batch_size=8 is invalid: it must be divisible by "
         "num_generations=16"),
    ],
)  # fmt: skip
def test_what_a_run_checks_at_start_is_one_line_before_the_warm_start(tmp_path, capsys, sets,
                                                                     message):  # fmt: skip
    """The reward functions and a -1 mesh axis's world size are not the config's to check (it
    imports nothing and touches no device); the run checks them first, before its SFT warm
    start (grpo_tiny has 500 steps of it), with the config's one-line error and exit 2."""
    args = ["train", "configs/grpo_tiny.yaml", "--set", f"output_dir={tmp_path}"]
    assert main([*args, *[a for s in sets for a in ("--set", s)]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(message), err
    assert not (tmp_path / "sft").exists()
