"""Bad input ends in one line naming the fix: a misspelled ``model.init`` key, an absurd device
count (refused before jax starts), bad ``jaxrl schedule`` input, impossible sampler log-probs,
a hung reward function, unreadable preference files; orbax's background noise stays quiet."""

from __future__ import annotations

import dataclasses
import json
import logging
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from jaxrl.cli import main
from jaxrl.config import ConfigError, load_run_config

ROOT = Path(__file__).resolve().parents[1]


def _err_lines(capsys) -> list[str]:
    return capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("model.init.hidden_sise=64", "unknown config key 'model.init.hidden_sise': did you mean "
         "'hidden_size'?"),
        ("model.init.dtype=bfloat16", "model.init.dtype is set by model.dtype: move it out"),
    ],
)  # fmt: skip
def test_a_bad_model_init_key_exits_2_naming_it(tmp_path, capsys, item, message):
    args = ["train", "configs/sft_tiny.yaml", "--set", f"output_dir={tmp_path}", "--set", item]
    assert main(args) == 2
    err = _err_lines(capsys)
    assert len(err) == 1 and err[0].startswith(f"config error: {message}"), err


def test_model_init_keys_are_the_model_config_fields():
    from jaxrl.config.sections.model import MODEL_INIT_KEYS, MODEL_SECTION_KEYS
    from jaxrl.models.model_config import ModelConfig

    names = {f.name for f in dataclasses.fields(ModelConfig)}
    assert set(MODEL_INIT_KEYS) | set(MODEL_SECTION_KEYS) == names
    assert not set(MODEL_INIT_KEYS) & set(MODEL_SECTION_KEYS)


def test_absurd_device_counts_are_refused_before_jax_starts():
    """In a fresh process (the test process has jax running): one line, exit 2, jax never
    imported; ``mesh.data=100000`` used to run 54 s, grow to 4 GB and die by SIGSEGV."""
    code = (
        "import sys; from jaxrl.cli import main; "
        "a = main(['train', 'configs/sft_tiny.yaml', '--set', 'mesh.data=100000']); "
        "b = main(['memory', 'configs/sft_tiny.yaml', '--devices', '100000']); "
        "print(a, b, 'jax' in sys.modules)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.stdout.split() == ["2", "2", "False"], proc.stderr[-2000:]
    err = proc.stderr.strip().splitlines()
    assert len(err) == 2, err
    assert err[0].startswith("config error: mesh.data=100000 x mesh.fsdp=1 x mesh.tensor=1 asks")
    assert "100000 CPU host devices" in err[0] and "more than the 2048" in err[0]
    assert "over 9.8 GB" in err[0] and err[1].startswith("config error: --devices=100000 asks")
    assert "more than the 4096 allowed" in err[1]  # planning runs no computation


def test_a_cpu_mesh_one_process_cannot_compute_over_is_refused_before_jax_starts():
    """``mesh.data=4096`` passed the host-device bound and then died inside XLA ("Multiprocess
    computations aren't implemented on the CPU backend", exit 1): now one line, exit 2, before
    jax is imported; planning the same mesh (``jaxrl memory``) still works."""
    code = (
        "import sys; from jaxrl.cli import main; "
        "a = main(['train', 'configs/sft_tiny.yaml', '--set', 'mesh.data=4096']); "
        "print(a, 'jax' in sys.modules)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.stdout.split() == ["2", "False"], proc.stdout + proc.stderr[-2000:]
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("config error: mesh.data=4096 x mesh.fsdp=1 x mesh.tensor=1 asks")
    assert "more than the 2048 XLA's CPU backend runs one computation over" in err[0], err
    assert "over 0.4 GB" in err[0], err


def test_a_mesh_larger_than_any_machine_is_a_config_error():
    with pytest.raises(ConfigError, match=r"mesh=.* is invalid: 1099511627776 devices is more"):
        load_run_config("configs/sft_tiny.yaml", ["mesh.data=1048576", "mesh.fsdp=1048576"])


@pytest.mark.parametrize(
    ("content", "options", "message"),
    [
        (b"100\n-5\n", [], "lengths.txt:2: -5 is not a length: use a positive integer"),
        (b"100\n0\n", [], "lengths.txt:2: 0 is not a length"),
        (b"# nothing\n\n", [], "lengths.txt: no lengths"),
        (b"", [], "lengths.txt: no lengths"),
        (b"100\n\xff\n", [], "lengths.txt:2: not UTF-8 (byte 0xff)"),
        (b"1" * 30 + b"\n", [], "is not a length: use a positive integer (at most"),
        (b"100\n200\n", ["--dp", "0"], "--dp=0 is invalid: use a positive integer"),
        (b"100\n200\n", ["--dp", "-3"], "--dp=-3 is invalid"),
        (b"100\n200\n", ["--micro-batch-group", "0"], "--micro-batch-group=0 is invalid"),
        (b"100\n200\n", ["--rollouts-per-step", "3"], "the lengths file holds 2 samples"),
        (b"100\n200\n", ["--max-tokens", "-1"], "--max-tokens=-1 is invalid"),
    ],
)
def test_bad_schedule_input_exits_2_with_one_line(tmp_path, capsys, content, options, message):
    lengths = tmp_path / "lengths.txt"
    lengths.write_bytes(content)
    args = ["schedule", "--lengths", str(lengths), "--dp", "2", "--max-tokens", "1024", *options]
    assert main(args) == 2
    err = _err_lines(capsys)
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def test_orbax_background_noise_is_dropped_unless_debugging(monkeypatch, caplog):
    from jaxrl.runtime.shutdown import install_hooks

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    install_hooks()

    def report(exc):
        sys.unraisablehook(type("U", (), {"exc_value": exc, "err_msg": None})())

    report(RuntimeError("Event loop is closed"))  # what orbax's threads leave
    other = RuntimeError("something else")
    report(other)
    assert seen and all(u.exc_value is other for u in seen)
    log = logging.getLogger("asyncio")
    log.error("Task exception was never retrieved\nfuture: <Task finished>")
    assert not caplog.records
    install_hooks(debug=True)  # --debug: everything again
    report(RuntimeError("Event loop is closed"))
    log.error("Task exception was never retrieved\nfuture: <Task finished>")
    assert len(seen) == 2 and len(caplog.records) == 1
    install_hooks(redeliver=True)  # as the CLI process (main() with argv=None)
    # Python's own SIGINT handler, as in a foreground shell: a runner started with SIGINT
    # ignored (`nohup pytest &`) would make the redelivery (interrupt_main) do nothing
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):  # a Ctrl-C a gc callback swallowed comes back
            report(KeyboardInterrupt())
            for _ in range(100):  # raised between bytecodes, within REDELIVER_S
                time.sleep(0.05)
    finally:
        signal.signal(signal.SIGINT, handler)
        install_hooks()  # a test runner is not the CLI: no late Ctrl-C in later tests


def test_a_library_s_report_of_ctrl_c_is_dropped_unless_debugging(caplog):
    """orbax logs the KeyboardInterrupt that passes through its wait for a checkpoint write
    ("Save Finalize thread failed", with a traceback); the CLI says "interrupted" once."""
    from jaxrl.runtime.shutdown import install_hooks

    absl = logging.getLogger("absl")
    install_hooks()
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt:
        absl.exception("[wait_until_finished] Save Finalize thread (save_finalize) failed.")
    absl.error("a real error")
    assert [r.getMessage() for r in caplog.records] == ["a real error"]
    install_hooks(debug=True)
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt:
        absl.exception("shown with --debug")
    assert caplog.records[-1].getMessage() == "shown with --debug"
    install_hooks()


# -- sampler log-probs, reward deadlines, preference files ---------------------------------


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"logps": [[-0.5, float("nan")], [-0.1]]}, r"sampler_logprobs\[0\]\[1\] = nan is not a"),
        ({"logps": [[-0.5, -0.2], [50.0]]}, r"sampler_logprobs\[1\]\[0\] = 50 is not a log-prob"),
        ({"logps": [[-0.5], [-0.1]]}, r"sampler_logprobs\[0\] has 1: give one log-prob per .* "
         r"\(2 in completion_tokens\[0\]\)"),
        ({"logps": [[-0.5, -0.2]]}, "1 sampler_logprobs rows for 2 completion_tokens rows"),
        ({"rewards": [1.0]}, "1 rewards rows for 2 completion_tokens rows"),
        ({"completions": [[3, 4], [1.5]]}, r"completion_tokens\[1\] is not a list of token ids"),
        ({"completions": [[3, 4], [19]]}, r"completion_tokens\[1\] holds ids outside \[0, 19\)"),
    ],
)  # fmt: skip
def test_train_on_rollouts_inputs_are_checked_row_by_row(change, message):
    from jaxrl.trainers.external_rollouts import check_rollouts

    rows = {"completions": [[3, 4], [5]], "logps": [[-0.5, -0.2], [1e-4]], "rewards": [1.0, 0.0]}
    check_rollouts([[1], [1]], rows["completions"], rows["logps"], rows["rewards"], None,
                   vocab_size=19)  # fmt: skip
    rows.update(change)
    with pytest.raises(ValueError, match=message):
        check_rollouts([[1], [1]], rows["completions"], rows["logps"], rows["rewards"], None,
                       vocab_size=19)  # fmt: skip


def test_a_reward_function_that_hangs_stops_at_its_deadline():
    from jaxrl.rollout.rewards.compute import RewardTimeoutError, score_completions
    from jaxrl.runtime.timeout import call_with_deadline

    release = threading.Event()

    def hang(prompts, completions, **_):
        release.wait(30)
        return [1.0] * len(completions)

    start = time.monotonic()
    with pytest.raises(
        RewardTimeoutError,
        match=r"reward function 'hang' did not return within grpo.reward_timeout=0.2 s \(scoring "
        r"rows 0-2 .*cannot be stopped, so the run stops",
    ):
        score_completions([hang], ["a", "b", "c"], ["x", "y", "z"], timeout=0.2)
    assert time.monotonic() - start < 5
    release.set()
    fast = lambda prompts, completions, **_: [0.5] * len(completions)
    assert score_completions([fast], ["a"], ["x"], timeout=5.0).tolist() == [[0.5]]
    with pytest.raises(ZeroDivisionError):  # an exception comes back as if called directly
        call_with_deadline(lambda: 1 / 0, 5.0)
    assert call_with_deadline(lambda: threading.current_thread().name, None) == "MainThread"


def test_reward_timeout_is_a_config_field_with_a_sane_default():
    cfg = load_run_config("configs/grpo_tiny.yaml")
    assert cfg.grpo.reward_timeout == 300.0
    off = load_run_config("configs/grpo_tiny.yaml", ["grpo.reward_timeout=null"])
    assert off.grpo.reward_timeout is None
    for bad in ("0", "-1"):
        with pytest.raises(ConfigError, match=f"reward_timeout={float(bad)!r} is invalid"):
            load_run_config("configs/grpo_tiny.yaml", [f"grpo.reward_timeout={bad}"])


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b'{"prompt": "p", "chosen": "c", "rejected": "r"}\n{"prompt": "\xe9"}\n',
         r"pairs.jsonl:2: not UTF-8 \(byte 0xe9 at column 13\)"),
        (b'{"prompt": "p", "chosen": "c", "rejected": "r"}\n' + b"[" * 100_000 + b"\n",
         r"pairs.jsonl:2: the value is nested too deeply to read"),
    ],
)  # fmt: skip
def test_preference_files_fail_with_the_file_and_line(tmp_path, data, message):
    from jaxrl.data.datasets import DataError, read_dataset

    path = tmp_path / "pairs.jsonl"
    path.write_bytes(data)
    with pytest.raises(DataError, match=message) as info:
        read_dataset(path, "dpo")
    with pytest.raises(DataError, match="no such file"):
        read_dataset(tmp_path / "missing.jsonl", "dpo")
    json.dumps(str(info.value))  # one printable line
    assert "\n" not in str(info.value)
