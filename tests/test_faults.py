"""Fault injection: every user mistake in the table ends in one line (two with the --debug hint)
and the right exit code; a full disk, Ctrl-C and SIGKILL (also in the middle of a checkpoint
write) leave a run that resumes exactly; a bit-flipped checkpoint is caught by its checksum."""

from __future__ import annotations

import contextlib
import errno
import gc
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_reliability import SMALL as RELIABILITY_SMALL

from jaxrl.cli import main
from jaxrl.train.run_io.checkpoint import Checkpointer

ROOT = Path(__file__).resolve().parents[1]
SMALL = [*RELIABILITY_SMALL, "mesh.data=1"]  # a one-layer D=32 model, 16 documents per step
# orbax's background thread may report its closed event loop after a failed restore
_ORBAX_NOISE = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def _sets(items):
    return [a for s in items for a in ("--set", s)]


def _run(config, items, capsys):
    code = main(["train", str(config), *_sets(items)])
    captured = capsys.readouterr()
    return code, captured.err.strip().splitlines(), captured.out


def _model_dir(root: Path, damage: str) -> Path:
    from hf_fixtures import write_case

    path, _ = write_case("qwen2", root)
    if damage == "truncated":
        f = path / "model.safetensors"
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])
    elif damage == "arch":
        cfg = json.loads((path / "config.json").read_text())
        gpt2 = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}
        (path / "config.json").write_text(json.dumps({**cfg, **gpt2}))
    elif damage == "config":
        (path / "config.json").write_text("{not json")
    elif damage == "tokenizer":
        (path / "tokenizer.json").write_text('{"version": "1.0", "model": 3')
        (path / "tokenizer_config.json").write_text('{"eos_token": "<eos>"}')
    return path


# (id, config, overrides (a callable of tmp_path may make files), exit code, message)
CASES = [
    ("invalid yaml", "bad.yaml", [], 2, "line 2, column 1: invalid YAML"),
    ("non-utf8 yaml", "latin.yaml", [], 2, "line 1: byte 0xe9 is not UTF-8"),
    ("unknown key", "sft", ["optimiser.learning_rate=1"], 2, "did you mean 'optimizer'"),
    ("negative seed", "sft", ["seed=-1"], 2, "seed=-1 is invalid"),
    ("max_steps 0", "sft", ["max_steps=0"], 2, "max_steps=0 is invalid"),
    ("mesh over devices", "sft", ["mesh.data=16"], 2, "mesh data=16"),
    ("batch moved", "sft", ["sft.batch_size=6"], 2, "set sft.per_device_train_batch_size to"),
    ("output_dir a file", "sft", ["output_dir={tmp}/afile"], 2, "afile' is a file"),
    ("output_dir under a file", "sft", ["output_dir={tmp}/afile/run"], 2, "afile' is a file"),
    ("model dir missing", "sft", ["model.path={tmp}/nope"], 2, "nope"),
    ("model truncated", "sft", ["model.path={model:truncated}"], 2, "model.safetensors"),
    ("model arch", "sft", ["model.path={model:arch}"], 2, "unsupported architecture"),
    ("model config.json", "sft", ["model.path={model:config}"], 2, "config.json"),
    ("tokenizer.json", "dpo", ["model.path={model:tokenizer}"], 2, "tokenizer.json"),
    (
        "grpo completion over row",
        "grpo",
        ["grpo.max_completion_length=4000"],
        2,
        "grpo.max_completion_length=4000 must fit one row",
    ),
    ("reward_weights", "grpo", ["grpo.reward_weights=[1.0]"], 2, "reward_weights"),
    ("dpo docs_per_step", "dpo", ["schedule.docs_per_step=3"], 2, "schedule.docs_per_step=3"),
    ("step over the data", "sft", ["task.train_size=8"], 2, "holds 8 documents"),
    ("dpo step over the data", "dpo", ["task.train_size=8"], 2, "training data holds"),
]
CONFIGS = {
    "sft": ROOT / "configs/sft_tiny.yaml",
    "grpo": ROOT / "configs/grpo_tiny.yaml",
    "dpo": ROOT / "configs/dpo_tiny.yaml",
}


@pytest.mark.slow
@_ORBAX_NOISE
@pytest.mark.parametrize(
    ("config", "items", "code", "message"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_user_mistakes_end_in_one_line(tmp_path, capsys, config, items, code, message):
    (tmp_path / "bad.yaml").write_text("seed: [1, 2\n")
    (tmp_path / "latin.yaml").write_bytes(b"output_dir: caf\xe9\n")
    (tmp_path / "afile").write_text("x")
    resolved = []
    for item in items:
        if "{model:" in item:
            damage = item.split("{model:")[1].rstrip("}")
            item = item.split("{model:")[0] + str(_model_dir(tmp_path / "m", damage))
        resolved.append(item.replace("{tmp}", str(tmp_path)))
    path = CONFIGS.get(config, tmp_path / config)
    base = [*SMALL, f"output_dir={tmp_path}/run", "max_steps=1"]
    if config in ("grpo", "dpo"):
        base.append("warm_start.steps=0")
    got, err, _ = _run(path, [*base, *resolved], capsys)
    gc.collect()
    assert got == code, err
    assert 1 <= len(err) <= 2 and "Traceback" not in "\n".join(err), err
    assert message in err[0], err[0]


def _train(tmp_path, name, capsys, *extra):
    items = [*SMALL, f"output_dir={tmp_path / name}", "max_steps=4", "checkpoint.every=1", *extra]
    return _run(ROOT / "configs/sft_tiny.yaml", items, capsys)


def _losses(run_dir: Path) -> list:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


@pytest.mark.slow
@_ORBAX_NOISE
def test_a_full_disk_is_one_line_and_the_run_resumes(tmp_path, capsys, monkeypatch):
    assert _train(tmp_path, "straight", capsys)[0] == 0
    original = Checkpointer.save

    def full(self, step, state, host):
        if step == 3:
            raise OSError(errno.ENOSPC, "No space left on device", str(self.directory / "3"))
        return original(self, step, state, host)

    monkeypatch.setattr(Checkpointer, "save", full)
    code, err, _ = _train(tmp_path, "full", capsys)
    assert code == 1 and len(err) == 1, err
    assert "no space left on the disk writing" in err[0] and "output_dir=" in err[0]
    monkeypatch.setattr(Checkpointer, "save", original)
    assert _train(tmp_path, "full", capsys)[0] == 0  # resumes from step 2
    assert _losses(tmp_path / "full") == _losses(tmp_path / "straight")


@pytest.mark.slow
def test_ctrl_c_says_where_the_last_checkpoint_is(tmp_path, capsys, monkeypatch):
    from jaxrl.trainers.session import Session

    original = Session.run_step

    def interrupted(self, *args, **kwargs):
        if self.step == 2:
            raise KeyboardInterrupt
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Session, "run_step", interrupted)
    code, err, _ = _train(tmp_path, "run", capsys)
    assert code == 130 and len(err) == 1, err
    assert "the last checkpoint is step 2 in" in err[0] and "to resume" in err[0]
    monkeypatch.setattr(Session, "run_step", original)
    code, err, _ = _train(tmp_path, "early", capsys, "checkpoint.every=0")
    assert code == 0


KILLER = """
import os, signal, sys
from jaxrl.train.run_io.checkpoint import Checkpointer
kill_at = int(os.environ["KILL_AT_STEP"])
save = Checkpointer.save
def dying(self, step, state, host):
    if step == kill_at:  # orbax's write has started; die before it commits
        self._manager.wait_until_finished = lambda: os.kill(os.getpid(), signal.SIGKILL)
    return save(self, step, state, host)
Checkpointer.save = dying
from jaxrl.cli import main
sys.exit(main(sys.argv[1:]))
"""


@_ORBAX_NOISE
@pytest.mark.slow
def test_sigkill_during_checkpoint_writes_resumes_exactly(tmp_path, capsys):
    assert _train(tmp_path, "straight", capsys)[0] == 0
    args = ["train", str(ROOT / "configs/sft_tiny.yaml")]
    args += _sets(
        [*SMALL, f"output_dir={tmp_path / 'killed'}", "max_steps=4", "checkpoint.every=1"]
    )
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the CLI sizes devices
    env.update(JAXRL_DEBUG="1", PYTHONPATH=str(ROOT))
    for kill_at in (2, 3):  # die inside the write of checkpoint 2, then of checkpoint 3
        proc = subprocess.run(
            [sys.executable, "-c", KILLER, *args],
            env={**env, "KILL_AT_STEP": str(kill_at)},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
        steps = Checkpointer(tmp_path / "killed" / "checkpoints").steps()
        assert max(steps) == kill_at - 1  # the half-written step is never listed
    proc = subprocess.run(
        [sys.executable, "-m", "jaxrl.cli", *args], env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert _losses(tmp_path / "killed") == _losses(tmp_path / "straight")


@_ORBAX_NOISE
def test_a_bit_flipped_checkpoint_fails_its_checksum_and_falls_back(tmp_path, capsys):
    assert _train(tmp_path, "run", capsys, "max_steps=2")[0] == 0
    newest = tmp_path / "run" / "checkpoints" / "2"
    assert (newest / "jaxrl_checksums.json").is_file()
    target = max((p for p in newest.rglob("*") if p.is_file() and "state" in p.parts),
                 key=lambda p: p.stat().st_size)  # fmt: skip
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x10  # one bit: the values may stay finite
    target.write_bytes(bytes(data))
    code, err, out = _train(tmp_path, "run", capsys, "max_steps=3")
    assert code == 0, err
    text = " ".join((out + " ".join(err)).split())
    assert "checkpoint step 2: unreadable (ChecksumError" in text and "changed since" in text
    assert "resumed from step 1" in text


def test_the_data_wraps_into_logged_epochs(tmp_path, capsys):
    code, err, _ = _train(tmp_path, "run", capsys, "task.train_size=24", "max_steps=3")
    assert code == 0, err
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # 16 documents per step out of 24: a new (reshuffled) epoch starts inside step 2
    assert [r["epoch"] for r in rows] == pytest.approx([16 / 24, 32 / 24, 48 / 24])


def test_text_the_tokenizer_cannot_represent_is_named_with_its_row(tmp_path):
    from jaxrl.data.datasets import DataError, read_dataset
    from jaxrl.data.documents import dpo_documents
    from jaxrl.data.tokenizer import UnknownTextError, char_tokenizer

    tok = char_tokenizer("0123456789+= ")
    rows = [{"prompt": "1+2=", "chosen": "3", "rejected": "4"}]
    rows.append({"prompt": "1+2=", "chosen": "3", "rejected": "three €"})  # not in the alphabet
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = read_dataset(path, "dpo")
    with pytest.raises(DataError, match=r"pairs.jsonl:2: text .* cannot represent .*'€'"):
        dpo_documents(data, tok, max_length=32)
    with pytest.raises(UnknownTextError, match="would silently become '<unk>'"):
        tok.encode("1+x")
    tok.allow_unknown = True  # opted in: encoded as <unk>, and counted
    assert tok.encode("1+x")[-1] == tok.unk_id and tok.unknown_count == 1


@contextlib.contextmanager
def _children_take_sigint():
    """Children started inside get SIGINT's default action, as from a foreground shell,
    whatever this runner inherited: ``nohup pytest &`` starts with SIGINT ignored, which
    children would inherit (an installed handler is reset to the default by exec). Set here
    in the parent: a ``preexec_fn`` would fork a multithreaded jax process."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _interrupt_when(proc: subprocess.Popen, ready, *, timeout: float = 90) -> tuple[int, str]:
    """SIGINT ``proc`` once ``ready(stderr_so_far)`` holds; ``(exit code, stderr)``."""
    import threading
    import time

    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout
    while not ready("".join(lines)) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    try:
        code = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        code = "still running 30 s after SIGINT"
    reader.join(timeout=10)
    return code, "".join(lines)


@pytest.mark.slow
def test_ctrl_c_in_every_phase_exits_130(tmp_path):
    """Ctrl-C while jax is imported (it used to be lost in jax's gc callback, and the run went
    on), during the first XLA compile (it used to die by SIGSEGV: the interpreter's teardown
    raced the compile still running in an XLA thread) and between steps: exit 130 with the one
    line, never a signal death or a traceback."""
    import time

    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAXRL_DEBUG")}
    env.update(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    start = time.monotonic()
    after_compile_starts = lambda err: "Compiling jit(" in err and time.sleep(0.5) is None
    phases = {  # name: (extra environment, when to interrupt, model)
        "import": ({}, lambda err: time.monotonic() - start > 1.0, []),
        "compile": ({"JAX_LOG_COMPILES": "1"}, after_compile_starts, []),  # a 5 s compile
        "step": ({}, lambda err: (tmp_path / "step" / "checkpoints" / "1").is_dir(), SMALL[:1]),
    }
    procs = {}
    try:
        with _children_take_sigint():
            for name, (extra, _, model) in phases.items():
                items = ["logging.progress=false", f"output_dir={tmp_path / name}"]
                items += [
                    "max_steps=1000",
                    "checkpoint.every=1",
                    "sft.per_device_train_batch_size=16",
                ]
                items += ["logging.eval_every=0", *model]
                config = str(ROOT / "configs/sft_tiny.yaml")
                procs[name] = subprocess.Popen(
                    [sys.executable, "-m", "jaxrl.cli", "train", config] + _sets(items),
                    env={**env, **extra},
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    text=True,
                )
        for name, (_, ready, _) in phases.items():
            code, err = _interrupt_when(procs[name], ready)
            ours = [x for x in err.splitlines() if x.strip() and not x.startswith("WARNING:")]
            assert code == 130, (name, code, err[-3000:])
            assert len(ours) == 1 and ours[0].startswith("interrupted"), (name, ours)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            proc.stderr.close()
