"""Storage URLs and preemption (docs/tpu_pod.md): a GRPO run with ``output_dir: gs://...``
against a GCS emulator writes its checkpoints, metrics, plot and ``hf/`` export there; SIGTERM
stops it at a saved step with the preemption code; the same command resumes from the bucket as
if never stopped; ``model.path: gs://.../hf`` reads the export back; local writes stay
atomic."""

from __future__ import annotations

import json
import os
import signal

import numpy as np
import pytest
from gcs_emulator import BUCKET, emulator_env, gcs_emulator
from test_scale_out import JOBS

from jaxrl.cli import main
from jaxrl.runtime import storage
from jaxrl.train.run_io.checkpoint import Checkpointer, verify_checksums
from jaxrl.train.run_io.metrics import read_metrics, reproducible
from jaxrl.train.run_io.preemption import PREEMPTED_EXIT, preempted_line


@pytest.fixture(scope="module")
def gcs():
    """``STORAGE_EMULATOR_HOST`` pointing at an in-memory GCS for this module's tests."""
    with gcs_emulator() as host, emulator_env(host):
        yield host


def test_storage_writes_and_lists_a_bucket(gcs, tmp_path):
    root = storage.path(f"gs://{BUCKET}/unit")
    storage.write_text(root / "a" / "x.txt", "one\n")
    storage.append_text(root / "a" / "x.txt", "two\n")  # no appends on GCS: rewritten whole
    storage.write_bytes(root / "b.bin", b"\0\1")
    assert (root / "a" / "x.txt").read_text() == "one\ntwo\n"
    assert [name for name, _ in storage.files(root)] == ["a/x.txt", "b.bin"]
    copy = storage.local(root)  # a local copy of the directory, for libraries that need one
    with open(os.path.join(copy, "a", "x.txt")) as f:
        assert f.read() == "one\ntwo\n"
    assert storage.absolute("gs://b/run") == storage.path("gs://b/run")  # no local "gs:" dir
    # locally a write goes to a temporary beside the target and is renamed over it
    storage.write_text(tmp_path / "f.json", "{}")
    storage.write_text(tmp_path / "f.json", '{"a": 1}')
    assert os.listdir(tmp_path) == ["f.json"] and json.loads((tmp_path / "f.json").read_text())


@pytest.mark.slow
def test_grpo_run_on_gcs_preempted_resumes_and_exports(gcs, tmp_path, monkeypatch, capsys):
    """grpo_tiny (scaled down) with output_dir on the emulator, sent SIGTERM while it writes
    step 2's checkpoint: the save completes, the run stops at step 2 with the preemption line
    and code, both checkpoints are intact; the same command resumes from the bucket and its
    metrics equal an uninterrupted local run's; every file lands in the bucket; the export loads
    with transformers and as model.path straight from gs://."""
    config, sets = JOBS["grpo"]
    url = f"gs://{BUCKET}/grpo_run"
    common = [*sets, "checkpoint.every=1", "checkpoint.keep=2", "logging.eval_every=0"]

    def train(out):
        args = ["train", config, "--set", f"output_dir={out}", "--set", "logging.progress=false"]
        for o in common:
            args += ["--set", o]
        return main(args)

    assert train(tmp_path / "local") == 0  # the uninterrupted reference
    want = [reproducible(r) for r in read_metrics(tmp_path / "local" / "metrics.jsonl")]
    save = Checkpointer.save

    def save_then_terminate(self, step, state, host):
        if step == 2:  # the notice lands mid-save: the handler only sets a flag
            os.kill(os.getpid(), signal.SIGTERM)
        save(self, step, state, host)

    monkeypatch.setattr(Checkpointer, "save", save_then_terminate)
    capsys.readouterr()
    assert train(url) == PREEMPTED_EXIT
    assert capsys.readouterr().err.strip().splitlines()[-1] == preempted_line(2)
    monkeypatch.setattr(Checkpointer, "save", save)
    run = storage.path(url)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["1", "2"]
    for step in (1, 2):  # both whole: verified against the checksums written after the save
        verify_checksums(run / "checkpoints" / str(step))
    assert not os.path.exists("gs:")  # nothing went to a local directory named after the URL
    assert train(url) == 0  # the same command resumes from the bucket's step 2
    assert "resumed from step 2" in capsys.readouterr().err
    got = [reproducible(r) for r in read_metrics(run / "metrics.jsonl")]
    assert [r["step"] for r in got] == [1, 2, 3]
    assert got == want  # bit for bit, as an uninterrupted run
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["2", "3"]  # keep=2
    names = {name for name, _ in storage.files(run)}
    assert {"config.json", "grpo_progress.png", "hf/config.json", "hf/tokenizer.json"} <= names
    assert "hf/model.safetensors" in names
    # the export, copied out of the bucket, loads with transformers ...
    import transformers

    local = storage.local(run / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(local)
    assert hf.config.num_hidden_layers == 2
    # ... and jaxrl reads it straight from gs:// (model.path)
    from jaxrl.models.hf import load_pretrained, read_config

    remote = load_pretrained(f"{url}/hf", read_config(f"{url}/hf"))
    here = load_pretrained(local, read_config(local))
    np.testing.assert_array_equal(
        np.asarray(remote.embedding[...]), np.asarray(here.embedding[...])
    )
