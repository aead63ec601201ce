"""One launch story (docs/tpu_pod.md): the README's and the pod guide's commands parse as
printed; ``jaxrl train`` and the Python API join the same multi-process job and build the same
mesh; a process that sees fewer devices than the mesh needs, with no ``distributed`` section,
is refused in one line."""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
from pathlib import Path

import pytest
from pod_worker import run_workers

from jaxrl.config import ConfigError, load_run_config
from jaxrl.runtime import launch

ROOT = Path(__file__).resolve().parents[1]
# a config that leaves mesh.data at its default (-1), as a user's own config may
MY_RUN = "configs/grpo_gsm8k_qwen.yaml"


def _train_commands(text: str) -> list[str]:
    """Every ``jaxrl train ...`` command of the bash blocks of ``text``, continuation lines
    joined, trailing comments and output redirections dropped."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = re.split(r" #| > ", line)[0].strip()  # a comment, a redirection
            if "jaxrl train" in line:
                commands.append(line[line.index("jaxrl train") :].rstrip('"'))
    return commands


def test_the_documented_pod_commands_parse():
    readme = (ROOT / "README.md").read_text()
    pod = readme[readme.index("## A TPU pod") :]
    pod = pod[: pod.index("\n## ", 1)]
    commands = _train_commands(pod) + _train_commands((ROOT / "docs" / "tpu_pod.md").read_text())
    assert len(commands) >= 4, commands
    for command in commands:
        words = shlex.split(command.replace("$NODE_RANK", "1").replace("$WORKER", "0"))
        assert words[:2] == ["jaxrl", "train"], command
        config = MY_RUN if words[2] == "configs/my_run.yaml" else words[2]
        flags, sets = words[3::2], words[4::2]
        assert set(flags) <= {"--set"}, command
        cfg = load_run_config(config, sets)  # raises ConfigError if refused
        assert cfg.distributed.enabled, command


def test_a_mesh_larger_than_the_devices_without_distributed_is_refused():
    cfg = load_run_config("configs/grpo_tiny.yaml", ["mesh.data=64"])
    with pytest.raises(ConfigError, match="needs 64 devices but this process sees 8") as e:
        launch.join(cfg.distributed, cfg.mesh)
    assert "distributed.auto=true" in str(e.value) and "\n" not in str(e.value)
    launch.join(cfg.distributed, load_run_config("configs/grpo_tiny.yaml", ["mesh.data=8"]).mesh)


def test_a_distributed_section_after_jax_started_is_refused_in_one_line():
    import jax

    jax.devices()  # this process runs jax single-process already
    cfg = load_run_config("configs/grpo_tiny.yaml", ["distributed.auto=true"])
    with pytest.raises(ConfigError, match="jax already started in this process"):
        launch.join(cfg.distributed, cfg.mesh)


@pytest.mark.slow
def test_cli_and_python_api_join_the_same_job_and_mesh(tmp_path):
    for mode in ("cli", "api"):
        run_workers(mode, tmp_path)
    got = {f.stem: json.loads(f.read_text()) for f in tmp_path.glob("*.json")}
    assert sorted(got) == ["api_0", "api_1", "cli_0", "cli_1"]
    want = got["cli_0"]
    assert want["processes"] == 2 and want["local_devices"] == 4
    assert want["shape"] == {"data": 2, "fsdp": 2, "tensor": 2}
    assert {p for _, p in want["devices"]} == {0, 1}  # the mesh spans both processes
    for name, value in got.items():
        assert value == want, name


def test_mesh_slices_lay_only_the_data_axis_across_slices():
    import jax
    import numpy as np

    from jaxrl.runtime.mesh import make_mesh, mesh_from_config

    devices = jax.devices()[:8]
    mesh = make_mesh(4, 2, 1, slices=2, devices=devices)
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    first, second = {d.id for d in devices[:4]}, {d.id for d in devices[4:]}
    assert set(ids[:2].flat) == first and set(ids[2:].flat) == second  # data crosses slices
    assert all({*ids[d].flat} <= first or {*ids[d].flat} <= second for d in range(4))  # fsdp not
    cfg = load_run_config("configs/grpo_tiny.yaml", ["mesh.data=4", "mesh.fsdp=2", "mesh.slices=2"])
    assert mesh_from_config(cfg.mesh, devices=devices).devices.tolist() == mesh.devices.tolist()
    with pytest.raises(ConfigError, match="mesh.data=3 is invalid: with mesh.slices=2"):
        load_run_config("configs/grpo_tiny.yaml", ["mesh.data=3", "mesh.slices=2"])
    with pytest.raises(ConfigError, match="must be a multiple of mesh.slices"):
        make_mesh(1, 8, 1, slices=2, devices=devices)  # fsdp may not cross the DCN


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None, reason="libtpu (the TPU compiler) not installed"
)
def test_memory_plans_the_configs_multislice_job(capsys):
    from jaxrl.cli import main

    code = main(
        ["memory", "configs/sft_tiny.yaml", "--topology", "v5p:2x2x2", "--slices", "2"]
        + ["--set", "mesh.data=4", "--set", "mesh.fsdp=4"]
    )
    out = capsys.readouterr()
    assert code == 0, out.err
    text = " ".join(out.out.split())  # the console wraps long lines
    assert "16 x TPU v5" in text and "across the DCN: data" in text, text
