"""rollout.backend: vllm against a stub server (tests/vllm_stub.py): the protocol, requests spread
over servers, weight versions (tagging, sync_every, half-done updates, other versions), every
failure path as one line within rollout.vllm.timeout, and the servers jaxrl starts are owned by
PID and leave no process behind. The real vLLM server is tests/test_vllm_server.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file
from vllm_stub import StubVLLM

from jaxrl.config import ConfigError, load_run_config
from jaxrl.config.sections.vllm import VLLMConfig
from jaxrl.generate.sampling import SamplingParams
from jaxrl.models.model_config import ModelConfig
from jaxrl.models.transformer import Transformer
from jaxrl.rollout.vllm import VLLMBackend, VLLMError, live_servers
from jaxrl.rollout.weight_sync import WeightSync

VOCAB, EOS, PAD = 16, 1, 0
STUB = str(Path(__file__).with_name("vllm_stub.py"))
KEY = jax.random.key(0)


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig.tiny(
        VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=64,
    )  # fmt: skip
    states = [nnx.state(Transformer(cfg, rngs=nnx.Rngs(s)), nnx.Param) for s in range(3)]
    return cfg, states


@pytest.fixture
def stubs():
    servers = [StubVLLM(VOCAB), StubVLLM(VOCAB)]
    yield servers
    for s in servers:
        s.stop()


def _backend(cfg, urls, *, timeout=5.0, verify=False, **kw) -> VLLMBackend:
    return VLLMBackend(
        cfg,
        VLLMConfig(url=urls, timeout=timeout, verify=verify),
        max_new_tokens=4,
        eos_id=EOS,
        pad_id=PAD,
        max_model_len=64,
        **kw,
    )


def _one_line(e: pytest.ExceptionInfo, url: str) -> str:
    message = str(e.value)
    assert "\n" not in message and url in message, message
    return message


def test_protocol_spreads_requests_and_tags_the_version(model, stubs):
    cfg, (p0, *_) = model
    a, b = stubs
    be = _backend(cfg, [a.url, b.url])
    be.load_params(p0, version=0)
    tag = f"{be.run_id}:0"
    assert a.version == b.version == tag
    assert a.calls == [
        "POST /pause", "POST /update_weight_version", "POST /collective_rpc",
        "POST /reset_prefix_cache", "POST /update_weight_version", "POST /resume",
    ]  # fmt: skip
    # the weights in the HF layout of jaxrl's exporter, the tied head written untied
    weights = Path(a.reloads[0])
    assert b.reloads == a.reloads and weights.name == "v0"
    tensors = load_file(str(weights / "model.safetensors"))
    np.testing.assert_array_equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"])
    assert json.loads((weights / "config.json").read_text())["tie_word_embeddings"] is False

    prompts = [[2, 3]] * 3 + [[14]] * 2 + [[7, 8]]
    res = be.generate(prompts, KEY)
    # the stub's rule: token i = (last + i + 1 + reloads) % 16, stopping after eos (1)
    expect = [[5, 6, 7, 8]] * 3 + [[0, 1, PAD, PAD]] * 2 + [[10, 11, 12, 13]]
    np.testing.assert_array_equal(res.tokens, expect)
    np.testing.assert_array_equal(res.lengths, [4, 4, 4, 2, 2, 4])
    np.testing.assert_array_equal(res.truncated, [1, 1, 1, 0, 0, 1])
    lp = np.asarray([-0.125, -0.25, -0.375, -0.5], np.float32)
    np.testing.assert_allclose(res.logprobs[0], lp)
    np.testing.assert_allclose(res.logprobs[3], [*lp[:2], 0, 0])
    assert res.weight_version == 0 and res.finish_reasons[3] == "stop"
    # one request per distinct prompt (n = its copies), round-robin over the servers
    assert sorted(r["n"] for r in a.requests) == [1, 3] and [r["n"] for r in b.requests] == [2]
    body = next(r for r in a.requests if r["n"] == 3)
    assert body["prompt"] == [2, 3] and body["stop_token_ids"] == [EOS]
    assert body["return_token_ids"] and body["logprobs"] == 0 and "seed" not in body
    assert be.metrics()["vllm/requests_0"] == 2.0

    # per-row limits, and greedy: one completion per distinct prompt, copied
    res = be.generate(prompts, KEY, max_tokens=[2, 2, 2, 4, 4, 1])
    np.testing.assert_array_equal(res.lengths, [2, 2, 2, 2, 2, 1])
    a.requests.clear()
    res = be.generate([[2, 3]] * 3, KEY, SamplingParams(temperature=0.0))
    assert [r["n"] for r in a.requests] == [1] and a.requests[0]["temperature"] == 0.0
    np.testing.assert_array_equal(res.tokens, [[5, 6, 7, 8]] * 3)
    with pytest.raises(VLLMError, match="exceeds its max_model_len=64") as e:
        be.generate([[3] * 62], KEY)  # the server's /server_info says 64
    _one_line(e, a.url)
    be.close()


def test_versions_sync_every_and_unchanged_weights(model, stubs):
    """The backend sends whatever it is told to load (the same arrays only once); when to sync
    is the trainer's policy (``WeightSync``, rollout.sync_every=2): a version one step newer
    keeps the servers' weights, an evaluation's unversioned load is never taken for a step's."""
    cfg, (p0, p1, p2) = model
    a = stubs[0]
    be = _backend(cfg, a.url)
    sync = WeightSync(be, every=2)

    def step(params, version):
        if sync.due(version):
            sync.load(params, version)

    step(p0, 0)
    be.load_params(p0, version=0)  # the same arrays: nothing sent
    step(p1, 1)  # one version old: the server keeps v0
    assert len(a.reloads) == 1 and be.generate([[3]], KEY).weight_version == 0
    step(p1, 2)
    assert len(a.reloads) == 2 and be.generate([[3]], KEY).weight_version == 2
    be.load_params(nnx.merge(be._graphdef, p2))  # an evaluation's (a model): its own version
    assert be.weight_version == 3 and len(a.reloads) == 3
    step(p1, 3)  # one version after the last sync, but the servers hold the evaluation's
    assert be.weight_version == 3 and len(a.reloads) == 4
    assert a.version == f"{be.run_id}:3"
    be.load_params(p2, version=4)  # told to load: sent, one version after the last
    assert be.weight_version == 4 and len(a.reloads) == 5
    be.close()


def test_a_half_done_update_or_another_version_is_never_sampled(model, stubs):
    cfg, (p0, p1, _) = model
    a = stubs[0]
    be = _backend(cfg, a.url)
    be.load_params(p0, version=0)
    a.fault = "reload_fails"
    with pytest.raises(VLLMError, match="POST /collective_rpc answered HTTP 500") as e:
        be.load_params(p1, version=1)
    assert "size mismatch" in _one_line(e, a.url)
    assert be.weight_version == 0 and a.version == "updating"
    a.fault = None
    with pytest.raises(VLLMError, match="half-done weight update") as e:
        be.generate([[3]], KEY)
    _one_line(e, a.url)
    be.load_params(p1, version=1)  # a complete update heals it
    assert be.generate([[3]], KEY).weight_version == 1
    a.version = "someone-else:7"  # another trainer (or a restart: None)
    with pytest.raises(VLLMError, match="weights jaxrl did not send") as e:
        be.generate([[3]], KEY)
    _one_line(e, a.url)
    be.close()


def test_each_sync_checks_the_servers_logprobs_against_jaxrls_scorer(model, stubs):
    """After the reload every server scores a probe sequence; a server whose answer is not
    jaxrl's scorer's on the weights sent (vLLM's stale tied head, another model) stops the
    run."""
    from jaxrl.train.score import Scorer

    cfg, (p0, p1, _) = model
    a = stubs[0]
    be = _backend(cfg, a.url, verify=True)
    graphdef = be._graphdef
    scorer = Scorer(graphdef, row_len=8)
    truth = {"params": p0}

    def score(ids):
        return scorer.token_logprobs(truth["params"], [np.asarray(ids, np.int32)])[0][1:]

    a.prompt_logprobs = score
    be.load_params(p0, version=0)  # the server's answer is the weights sent: passes
    probe = next(r for r in a.requests if r.get("prompt_logprobs") == 0)
    assert probe["max_tokens"] == 1 and len(probe["prompt"]) == 8
    with pytest.raises(VLLMError, match="serves other weights than jaxrl sent") as e:
        be.load_params(p1, version=1)  # the server still answers with p0: stale
    _one_line(e, a.url)
    truth["params"] = p1
    be.load_params(p1, version=2)
    assert be.weight_version == 2
    be.close()


@pytest.mark.parametrize(
    ("fault", "says"),
    [
        ("hang", "no answer within rollout.vllm.timeout=1 s"),
        ("http500", "POST /v1/completions answered HTTP 500 (EngineCore encountered an issue)"),
        ("fewer", "returned 1 completions for n=2"),
        ("malformed", "malformed completion"),
        ("bad_token", "vocabulary 16"),
        ("drop", "the server is down or unreachable"),
        ("dead", "the server is down or unreachable"),
    ],
)
def test_every_failure_is_one_line_within_the_timeout(model, stubs, fault, says):
    cfg, (p0, *_) = model
    a = stubs[0]
    a.hang_s = 4.0
    be = _backend(cfg, a.url, timeout=1.0)
    be.load_params(p0, version=0)
    be.generate([[3], [3]], KEY)  # healthy first
    if fault == "dead":
        a.stop()
    else:
        a.fault = fault
    start = time.monotonic()
    with pytest.raises(VLLMError) as e:
        be.generate([[3], [3]], KEY)
    took = time.monotonic() - start
    assert says in _one_line(e, a.url) and took < 1.0 + 1.5, (str(e.value), took)
    be.close()


def test_temperature_needs_the_servers_processed_logprobs(model):
    cfg, (p0, *_) = model
    raw, processed = StubVLLM(VOCAB), StubVLLM(VOCAB, logprobs_mode="processed_logprobs")
    try:
        warm = SamplingParams(temperature=0.7)
        be = _backend(cfg, raw.url, sampling=warm)
        be.load_params(p0, version=0)
        with pytest.raises(VLLMError, match="--logprobs-mode processed_logprobs") as e:
            be.generate([[3]], KEY)
        _one_line(e, raw.url)
        assert be.generate([[3]], KEY, SamplingParams()).lengths[0] == 4  # T = 1: raw is right
        be = _backend(cfg, processed.url, sampling=warm)
        be.load_params(p0, version=0)
        assert be.generate([[3]], KEY).lengths[0] == 4
    finally:
        raw.stop()
        processed.stop()


def _gone(pgid: int, wait_s: float = 5.0) -> bool:
    """No live (non-zombie) process is left in process group ``pgid`` (within ``wait_s``: an
    orphaned child is reaped by init a moment later)."""
    deadline = time.monotonic() + wait_s
    while True:
        alive = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                alive.append(stat.parent.name)
        if not alive or time.monotonic() > deadline:
            return not alive
        time.sleep(0.1)


def test_a_started_server_is_owned_and_leaves_no_process(model, tmp_path):
    cfg, (p0, *_) = model
    command = [sys.executable, STUB, "{port}", str(VOCAB)]
    be = VLLMBackend(
        cfg, VLLMConfig(command=command, timeout=5.0, start_timeout=60.0, verify=False),
        max_new_tokens=4, eos_id=EOS, pad_id=PAD, log_dir=tmp_path,
    )  # fmt: skip
    be.load_params(p0, version=0)
    (server,) = be.servers
    assert live_servers() == [server] and be.generate([[3]], KEY).weight_version == 0
    be.close()
    assert _gone(server.pid) and live_servers() == []
    be.close()  # again: nothing to do

    failing = [sys.executable, STUB, "--exit", "3"]
    be = VLLMBackend(
        cfg, VLLMConfig(command=failing, start_timeout=60.0),
        max_new_tokens=4, eos_id=EOS, pad_id=PAD, log_dir=tmp_path / "fail",
    )  # fmt: skip
    with pytest.raises(VLLMError, match="exited with code 3 while starting: ValueError: stub"):
        be.load_params(p0, version=0)
    assert live_servers() == []


def test_the_cli_hard_exit_stops_started_servers(tmp_path):
    """Ctrl-C in the CLI ends the process by ``exit_now`` (no atexit): the server and its child
    process still go."""
    code = (
        "import sys; from jaxrl.rollout.vllm.server import LocalServer, free_port\n"
        "from jaxrl.runtime.shutdown import exit_now\n"
        "port = free_port()\n"
        f"s = LocalServer([sys.executable, {STUB!r}, str(port), '16'], port=port, "
        f"log_path={str(tmp_path / 'log')!r})\n"
        "s.wait_ready(60); print(s.pid, flush=True); exit_now(130)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )  # fmt: skip
    assert out.returncode == 130, out.stderr
    assert _gone(int(out.stdout.split()[0]))


def test_config_keys():
    cfg = load_run_config(
        "configs/grpo_tiny.yaml",
        ["rollout.backend=vllm", "rollout.vllm.url=[http://a:1, http://b:2/]",
         "rollout.sync_every=3", "rollout.vllm.timeout=5"],
    )  # fmt: skip
    assert cfg.rollout.vllm.urls == ["http://a:1", "http://b:2"]
    assert cfg.rollout.sync_every == 3 and cfg.rollout.vllm.timeout == 5.0
    for bad, field in [
        ("rollout.backend=sglang", "rollout.backend"),
        ("rollout.vllm.url=localhost:8000", "rollout.vllm.url"),
        ("rollout.sync_every=0", "rollout.sync_every"),
        ("rollout.vllm.timeout=0", "rollout.vllm.timeout"),
    ]:
        with pytest.raises(ConfigError, match=field):
            load_run_config("configs/grpo_tiny.yaml", [bad])


def test_grpo_with_the_server_as_generator_tags_versions_and_staleness(tmp_path):
    """A GRPO run whose rollouts come from the (stub) server: rollout.sync_every=2 sends the
    weights every other step, the rows of the step in between carry the older version
    (staleness 1, measured by the trainer) and the server's log-probs reach
    sampler/logprob_mismatch."""
    from test_grpo_e2e import CONFIG, TINY

    from jaxrl.trainers.grpo import GRPOTrainer

    stub = StubVLLM(10)  # ids below every task vocabulary
    try:
        cfg = load_run_config(
            CONFIG,
            [*TINY, f"output_dir={tmp_path}", "rollout.backend=vllm", "rollout.sync_every=2",
             f"rollout.vllm.url={stub.url}", "task.eval_size=4", "rollout.vllm.verify=false"],
        )  # fmt: skip
        t = GRPOTrainer(cfg)
        rows = [t.step() for _ in range(3)]
        t.generator.close()
    finally:
        stub.stop()
    assert [r["rollout/staleness_max"] for r in rows] == [0, 1, 0]
    assert [r["vllm/syncs"] for r in rows] == [1.0, 0.0, 1.0]
    # 2 distinct prompts (× G = 4) per step; the first row also holds the starting evaluation's
    assert [r["vllm/requests_0"] for r in rows[1:]] == [2.0, 2.0] and rows[0]["vllm/requests_0"] > 2
    assert all(r["sampler/logprob_mismatch"] > 0.1 for r in rows)  # the stub's made-up log-probs
    assert len(stub.reloads) == 2 and live_servers() == []


def test_cli_one_line_when_the_server_is_down(tmp_path, capsys):
    from test_grpo_e2e import CONFIG, TINY

    from jaxrl.cli import main
    from jaxrl.rollout.vllm.server import free_port

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    sets = [*TINY, f"output_dir={tmp_path}", "rollout.backend=vllm", f"rollout.vllm.url={url}"]
    start = time.monotonic()
    code = main(["train", CONFIG, *[a for s in sets for a in ("--set", s)]])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and time.monotonic() - start < 60
    assert err[0].startswith(f"error: vLLM server {url}: POST /pause failed"), err
    assert "down or unreachable" in err[0] and len(err) <= 2  # + the --debug hint


def test_launcher_hides_the_cuda_only_packages_on_a_cpu_torch():
    """jaxrl/rollout/vllm/api_server.py (the server jaxrl starts): on a CPU torch build,
    torchvision / torchaudio / torchcodec read as not installed before vLLM is imported, also
    when multiprocessing's spawn re-runs it as __mp_main__; JAXRL_VLLM_HIDE overrides."""
    from jaxrl.rollout.vllm.server import LAUNCHER, default_command

    assert default_command("m", 1, dtype="float32", max_model_len=8, logprobs_mode="raw")[1] == (
        str(LAUNCHER)
    )
    probe = (
        "import importlib.util, runpy, sys, torch; "
        f"runpy.run_path({str(LAUNCHER)!r}, run_name='__mp_main__'); "
        "print(torch.version.cuda is None, [importlib.util.find_spec(n) is None "
        "for n in ('torchvision', 'torchaudio', 'torchcodec')])"
    )
    env = {k: v for k, v in os.environ.items() if k != "JAXRL_VLLM_HIDE"}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    cpu, hidden = out.stdout.split(" ", 1)
    assert hidden.strip() == str([cpu == "True"] * 3), out.stdout
    env["JAXRL_VLLM_HIDE"] = "tomllib"
    probe = (
        f"import runpy; runpy.run_path({str(LAUNCHER)!r}, run_name='__mp_main__')\n"
        "try:\n import tomllib\nexcept ImportError:\n print('hidden')"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env)
    assert out.stdout.strip() == "hidden", (out.stdout, out.stderr[-2000:])


# what vLLM's architecture inspection does: a fresh interpreter (``python -m
# vllm.model_executor.models.registry``), and what multiprocessing's spawn does
_CHILDREN = """
import importlib.util, multiprocessing, runpy, subprocess, sys

def probe(q):
    q.put(importlib.util.find_spec("tomllib") is None)

if __name__ == "__main__":
    runpy.run_path(sys.argv[1], run_name="__launcher__")  # its set-up, not vLLM's server
    child = "import importlib.util; print(importlib.util.find_spec('tomllib') is None)"
    run = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True)
    print("subprocess", run.stdout.strip())
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=probe, args=(q,))
    p.start()
    print("spawn", q.get(timeout=60))
    p.join()
"""


def test_the_hiding_reaches_every_process_the_server_starts(tmp_path):
    """The packages are hidden in the fresh interpreters the server starts, too (vLLM's model
    inspection runs ``python -m vllm.model_executor.models.registry``, which imports
    transformers and so torchvision: on a fresh machine, with vLLM's caches empty, it killed
    the server), and a ``sitecustomize`` of the environment's own still runs there."""
    from jaxrl.rollout.vllm.server import LAUNCHER

    own = tmp_path / "own_site"
    own.mkdir()
    (own / "sitecustomize.py").write_text("import sys\nsys.own_site_ran = True\n")  # per process
    script = tmp_path / "children.py"
    script.write_text(_CHILDREN)
    env = {**os.environ, "JAXRL_VLLM_HIDE": "tomllib", "PYTHONPATH": str(own)}
    out = subprocess.run(
        [sys.executable, str(script), str(LAUNCHER)], capture_output=True, text=True, env=env,
        timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["subprocess", "True", "spawn", "True"], out.stdout
    env["JAXRL_VLLM_HIDE"] = ""  # hides nothing
    out = subprocess.run(
        [sys.executable, str(script), str(LAUNCHER)], capture_output=True, text=True, env=env,
        timeout=120,
    )  # fmt: skip
    assert out.stdout.split() == ["subprocess", "False", "spawn", "False"], out.stdout
    # the environment's own sitecustomize, shadowed by the launcher's, still runs in children
    child = "import sys; print(getattr(sys, 'own_site_ran', False))"
    code = f"import runpy, subprocess, sys; runpy.run_path({str(LAUNCHER)!r}); " + (
        f"print(subprocess.run([sys.executable, '-c', {child!r}], capture_output=True, "
        "text=True).stdout.strip())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.stdout.strip() == "True", (out.stdout, out.stderr[-2000:])


def test_async_grpo_with_the_server_honours_max_staleness(tmp_path):
    """rollout.max_staleness=2 with the (stub) server as generator: the pipeline's worker
    generates ahead through the backend, every trained row lags its generating weights by at
    most 2 versions (0, 1, 2, 2, 2: the first three generations are made by version 0), and
    the version each batch is tagged with is the one the server held when it answered (never
    a half-done update)."""
    from test_grpo_e2e import CONFIG, TINY

    from jaxrl.trainers.grpo import GRPOTrainer

    stub = StubVLLM(10)
    try:
        cfg = load_run_config(
            CONFIG,
            [*TINY, f"output_dir={tmp_path}", "rollout.backend=vllm", "rollout.max_staleness=2",
             f"rollout.vllm.url={stub.url}", "task.eval_size=4", "rollout.vllm.verify=false"],
        )  # fmt: skip
        t = GRPOTrainer(cfg)
        rows = [t.step() for _ in range(5)]
        t.generator.close()
    finally:
        stub.stop()
    staleness = [r["rollout/staleness_max"] for r in rows]
    assert staleness == [0, 1, 2, 2, 2]
    assert all(r["rollout/staleness_mean"] == r["rollout/staleness_max"] for r in rows)
    served = [int(str(v).rsplit(":", 1)[1]) for v in stub.served]  # "updating" fails here
    tagged = [step - staleness[step] for step in range(5)]  # step s+1 trains after s updates
    assert set(tagged) <= set(served) and served == sorted(served), (tagged, served)
    assert live_servers() == []
