"""rollout.backend: vllm against a real vLLM server (pip install -e ".[vllm]", the CPU build):
one server per module on a tiny checkpoint jaxrl exports. After a weight update the server's
log-probs of a fixed completion are jaxrl's scorer's on the new weights; near-greedy GRPO through
the server makes the engine's completions and metrics; a run whose server is killed ends with
exit 1 and one line within rollout.vllm.timeout + 10 s, leaving no vLLM process.

The servers start from empty vLLM and XDG caches (a fresh machine's). Skipped when vllm is not
installed (CI does not install it: docs/rollout.md, "Tests"). Run:
``python -m pytest -m vllm tests/test_vllm_server.py -n 0`` (about 5 minutes on 2 cores).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from flax import nnx
from test_grpo_e2e import CONFIG
from test_vllm_backend import _gone

from jaxrl.config import load_run_config
from jaxrl.config.sections.vllm import VLLMConfig
from jaxrl.models.transformer import Transformer
from jaxrl.rollout.vllm import LocalServer, ServerClient, VLLMBackend, export_weights
from jaxrl.rollout.vllm.server import default_command, free_port
from jaxrl.train.score import Scorer
from jaxrl.trainers.grpo import GRPOTrainer

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
]

# vLLM's CPU attention takes head sizes 32, 64, ...: hidden 64 over 2 heads
MODEL = (
    "model.init={hidden_size: 64, num_hidden_layers: 1, num_attention_heads: 2, "
    "num_key_value_heads: 1, intermediate_size: 128}"
)
SETS = [
    "logging.progress=false",
    "warm_start.steps=0",
    MODEL,
    "task.train_size=64",
    "task.eval_size=8",
    "schedule.max_tokens=64",
    "optimizer.warmup_steps=0",
    "optimizer.warmup_steps=0",
    "optimizer.learning_rate=3.0e-2",
    "grpo.max_completion_length=4",
    "grpo.num_generations=4",
    "grpo.per_device_train_batch_size=8",
    "logging.eval_every=0",
]


@pytest.fixture(scope="module", autouse=True)
def empty_caches(tmp_path_factory):
    """Every server of this module starts from empty caches, as on a fresh machine: vLLM's
    (``VLLM_CACHE_ROOT``: its model-inspection results among them, whose miss starts the
    inspection subprocess that once died on the CUDA torchvision) and the XDG cache under it."""
    root = tmp_path_factory.mktemp("caches")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(root / "xdg"))
        mp.setenv("VLLM_CACHE_ROOT", str(root / "vllm"))
        yield root
    assert (root / "vllm" / "modelinfos").is_dir()  # the inspection ran (and so did its fix)


@pytest.fixture(scope="module")
def engine_run(tmp_path_factory):
    """A near-greedy GRPO run on jaxrl's engine (the reference), 3 steps."""
    out = tmp_path_factory.mktemp("engine")
    t = GRPOTrainer(load_run_config(CONFIG, [*SETS, f"output_dir={out}", "grpo.temperature=1e-3"]))
    params0 = t.session.policy_params
    dense = t.generator.sampler.config
    exported = export_weights(
        t.session.graphdef, params0, out / "ckpt", dtype="float32",
        eos_ids=[t.tokenizer.eos_id], pad_id=t.tokenizer.pad_id,
    )  # fmt: skip
    rows = [t.step() for _ in range(3)]
    return t, dense, exported, rows


@pytest.fixture(scope="module")
def server(engine_run, tmp_path_factory):
    """One real server on the run's exported initial weights (processed log-probs: the GRPO
    test samples at T = 1e-3)."""
    _, _, exported, _ = engine_run
    port = free_port()
    command = default_command(
        str(exported), port, dtype="float32", max_model_len=64,
        logprobs_mode="processed_logprobs",
    )  # fmt: skip
    env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    log = tmp_path_factory.mktemp("server") / "vllm.log"
    s = LocalServer(command, port=port, log_path=log, env=env)
    try:
        s.wait_ready(600)
        yield s
    finally:
        s.stop()
        assert _gone(s.pid)


def _server_logprobs(url: str, sequence: list[int], prompt_len: int) -> np.ndarray:
    """The server's log-probs of ``sequence[prompt_len:]`` given what precedes each token."""
    answer = ServerClient(url, 60).completions(
        {"prompt": sequence, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 0.0,
         "return_tokens_as_token_ids": True}
    )  # fmt: skip
    per_token = answer["choices"][0]["prompt_logprobs"]
    return np.asarray(
        [per_token[i][str(sequence[i])]["logprob"] for i in range(prompt_len, len(sequence))]
    )


def test_weight_update_makes_the_servers_logprobs_jaxrls(engine_run, server):
    t, dense, _, _ = engine_run
    graphdef, new = nnx.split(Transformer(t.session.model_config, rngs=nnx.Rngs(1)), nnx.Param)
    scorer = Scorer(graphdef, row_len=64)
    sequence, p = [3, 4, 5, 7, 8, 9, 10], 3
    jaxrl_new = scorer.token_logprobs(new, [np.asarray(sequence, np.int32)])[0][p:]
    before = _server_logprobs(server.url, sequence, p)
    assert np.abs(before - jaxrl_new).mean() > 1e-3  # the initial weights: not yet the new
    be = VLLMBackend(
        dense, VLLMConfig(url=server.url), max_new_tokens=4, eos_id=t.tokenizer.eos_id,
        pad_id=t.tokenizer.pad_id, max_model_len=64,
    )  # fmt: skip
    be.load_params(new, version=5)
    after = _server_logprobs(server.url, sequence, p)
    assert np.abs(after - jaxrl_new).mean() <= 1e-4, (after, jaxrl_new)
    be.close()


def test_near_greedy_grpo_through_the_server_matches_the_engine(engine_run, server, tmp_path):
    _, _, _, engine_rows = engine_run
    sets = [*SETS, f"output_dir={tmp_path}", "grpo.temperature=1e-3", "rollout.backend=vllm",
            f"rollout.vllm.url={server.url}"]  # fmt: skip
    t = GRPOTrainer(load_run_config(CONFIG, sets))
    rows = [t.step() for _ in range(3)]
    t.generator.close()
    for ours, ref in zip(rows, engine_rows, strict=True):
        for k in ("reward", "completions/mean_length", "loss", "entropy", "grad_norm"):
            assert abs(ours[k] - ref[k]) <= 1e-4, (k, ours[k], ref[k])
        assert ours["sampler/logprob_mismatch"] <= 1e-4


def test_killing_the_server_mid_run_is_one_line_and_leaves_no_process(tmp_path):
    """The run starts its own server; SIGKILL of the API server mid-run: exit 1, one line,
    within rollout.vllm.timeout + 10 s, and nothing of the server left."""
    timeout = 20
    sets = [*SETS, f"output_dir={tmp_path}", "rollout.backend=vllm", "max_steps=500",
            f"rollout.vllm.timeout={timeout}"]  # fmt: skip
    cmd = [sys.executable, "-m", "jaxrl.cli", "train", CONFIG]
    cmd += [a for s in sets for a in ("--set", s)]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one device, as a user's
    run = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    metrics = Path(tmp_path) / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
        assert run.poll() is None and time.monotonic() < deadline, run.stderr.read()
        time.sleep(1)
    out = subprocess.run(["pgrep", "-P", str(run.pid), "-f", "api_server"], capture_output=True)
    (pid,) = [int(x) for x in out.stdout.split()]
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    _, err = run.communicate(timeout=timeout + 60)
    took = time.monotonic() - killed
    lines = [x for x in err.strip().splitlines() if x.startswith("error:")]
    assert run.returncode == 1 and took < timeout + 10, (run.returncode, took, err[-2000:])
    assert len(lines) == 1 and "vLLM server http://127.0.0.1:" in lines[0], err[-2000:]
    assert _gone(pid)
    print(json.dumps({"exit": run.returncode, "seconds": round(took, 1), "line": lines[0]}))
