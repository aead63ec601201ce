"""The rollout interface is the whole of what callers use of a backend (DESIGN rule 15,
docs/rollout.md): every attribute jaxrl's code reads from a rollout backend is declared on
``RolloutBackend`` (an AST scan of jaxrl/, and a recording proxy around the backend of a real
GRPO run, evaluation included), nothing probes a backend with ``getattr`` / ``hasattr``, backends
come from one factory keyed by ``rollout.backend``, and the weight-sync policy
(``rollout.sync_every``) is the trainer's ``WeightSync``."""

from __future__ import annotations

import ast
import dataclasses
import typing
from pathlib import Path

import pytest

from jaxrl.config import RolloutConfig, load_run_config
from jaxrl.config.sections.vllm import VLLMConfig
from jaxrl.generate.backend import RolloutBackend
from jaxrl.generate.sampler import Sampler
from jaxrl.generate.sampling import SamplingParams
from jaxrl.models.model_config import ModelConfig
from jaxrl.rollout import backends
from jaxrl.rollout.weight_sync import WeightSync

ROOT = Path(__file__).resolve().parents[1]
# the backends themselves and the engine's own parts (a session holds its concrete Sampler)
IMPLEMENTATIONS = {
    "jaxrl/generate/backend.py",
    "jaxrl/generate/sampler.py",
    "jaxrl/generate/session.py",
    "jaxrl/rollout/vllm/backend.py",
}
BACKEND_NAMES = {"sampler", "backend"}  # what jaxrl calls a variable or attribute holding one
CONSTRUCTORS = {"Sampler", "VLLMBackend", "build_backend"}  # calls that make one


def declared() -> set[str]:
    """The members ``RolloutBackend`` declares: annotated attributes and its own methods."""
    members = {n for n in vars(RolloutBackend) if not n.startswith("_")}
    return members | set(RolloutBackend.__annotations__)


def scan(source: str) -> tuple[set[str], list[str]]:
    """(attributes read from a backend, probes) in ``source``. A backend is an expression
    ``<x>.sampler`` / ``<x>.backend``, a name ``sampler`` / ``backend``, a parameter annotated
    ``RolloutBackend``, or a name assigned from a constructor; a probe is ``getattr`` or
    ``hasattr`` on one."""
    tree = ast.parse(source)
    bound = set(BACKEND_NAMES)
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and node.annotation is not None:
            if "RolloutBackend" in ast.unparse(node.annotation):
                bound.add(node.arg)
        if isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(node.value, ast.Call):
            func = node.value.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if name in CONSTRUCTORS:
                bound |= {t.id for t in targets if isinstance(t, ast.Name)}

    def is_backend(e: ast.expr) -> bool:
        return (isinstance(e, ast.Attribute) and e.attr in BACKEND_NAMES) or (
            isinstance(e, ast.Name) and e.id in bound
        )

    reads, probes = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_backend(node.value):
            reads.add(node.attr)
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and node.args
            and is_backend(node.args[0])
        ):
            probes.append(f"line {node.lineno}: {ast.unparse(node)}")
    return reads, probes


def test_every_attribute_callers_read_from_a_backend_is_declared():
    reads, probes, readers = set(), [], {}
    for path in sorted((ROOT / "jaxrl").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in IMPLEMENTATIONS:
            continue
        got, found = scan(path.read_text())
        reads |= got
        probes += [f"{rel} {p}" for p in found]
        for attr in got:
            readers.setdefault(attr, []).append(rel)
    # what the callers read today (a scan that finds nothing checks nothing)
    assert {"generate", "load_params", "config", "sampling", "session", "precompile"} <= reads
    undeclared = {a: readers[a] for a in reads - declared()}
    assert not undeclared, f"declare these on RolloutBackend (read by): {undeclared}"
    assert not probes, f"no probing of backends: {probes}"


def test_the_scan_finds_an_undeclared_read_and_a_probe():
    """The check above can fail: an undeclared member read, or a probe, is reported."""
    source = (
        "def f(sampler, other: RolloutBackend):\n"
        "    sampler.generate([[1]], key)\n"
        "    other.warm_up()\n"
        "    made = build_backend(spec)\n"
        "    made.drain()\n"
        "    if hasattr(self.sampler, 'close'):\n"
        "        getattr(other, 'metrics', None)\n"
    )
    reads, probes = scan(source)
    assert reads - declared() == {"warm_up", "drain"}
    assert len(probes) == 2


class Recording:
    """A backend that records every attribute read or set on it (dunders aside)."""

    def __init__(self, backend: RolloutBackend, seen: set[str]):
        object.__setattr__(self, "_recording", (backend, seen))

    def __getattribute__(self, name: str):
        backend, seen = object.__getattribute__(self, "_recording")
        if not name.startswith("__"):
            seen.add(name)
        return getattr(backend, name)

    def __setattr__(self, name: str, value) -> None:
        backend, seen = object.__getattribute__(self, "_recording")
        seen.add(name)
        setattr(backend, name, value)


def test_a_grpo_run_uses_only_declared_members(tmp_path, monkeypatch):
    """The backend of a real GRPO run (weight syncs, generation, the held-out evaluation sharing
    it, precompiles, the compile counter, metrics, close) wrapped in a recording proxy: every
    attribute the run touched is declared."""
    from test_grpo_e2e import CONFIG, TINY

    from jaxrl.rollout import generator
    from jaxrl.trainers.grpo import GRPOTrainer

    seen: set[str] = set()
    build = backends.build_backend
    monkeypatch.setattr(generator, "build_backend", lambda spec: Recording(build(spec), seen))
    cfg = load_run_config(CONFIG, [*TINY, f"output_dir={tmp_path}", "task.eval_size=4"])
    t = GRPOTrainer(cfg)
    assert t.evaluator is not None and t.evaluator.sampler is t.generator.sampler
    rows = [t.step() for _ in range(2)]
    t.generator.close()
    assert rows[-1]["compiles"] > 0
    assert {"load_params", "generate", "weight_version", "compiles", "metrics"} <= seen
    assert seen <= declared(), f"declare these on RolloutBackend: {seen - declared()}"


def _spec(**rollout) -> backends.BackendSpec:
    config = ModelConfig.tiny(
        16, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=64,
    )  # fmt: skip
    return backends.BackendSpec(
        config=config, rollout=RolloutConfig(**rollout), max_new_tokens=4, eos_id=1, pad_id=0,
        sampling=SamplingParams(), max_model_len=32,
    )  # fmt: skip


def test_one_factory_builds_every_kind_and_says_where_sync_every_applies():
    choices = typing.get_args(
        typing.get_type_hints(RolloutConfig)["backend"]
    )  # the values rollout.backend accepts
    assert set(backends.BACKENDS) == set(choices)
    engine = backends.build_backend(_spec(sync_every=3))
    assert isinstance(engine, Sampler) and engine.max_new_tokens == 4
    # the engine reads the trainer's arrays (a synchronous run donates them): every version
    assert backends.weight_sync(engine, RolloutConfig(sync_every=3)).every == 1
    vllm = _spec(backend="vllm", sync_every=3, vllm=VLLMConfig(url="http://127.0.0.1:9"))
    be = backends.build_backend(vllm)  # no server is contacted before the first sync
    try:
        assert type(be).__name__ == "VLLMBackend" and isinstance(be, RolloutBackend)
        assert be.memory_bytes(8, 2, 16) == be.weight_bytes() == 0  # not on jaxrl's devices
        assert backends.weight_sync(be, vllm.rollout).every == 3
    finally:
        be.close()


class Loads(RolloutBackend):
    """A backend that records what it is told to load."""

    def __init__(self):
        self.loads: list[int | None] = []

    def generate(self, prompts, key, sampling=None, *, max_tokens=None):
        raise NotImplementedError

    def load_params(self, params, *, copy=None, version=None):
        self.loads.append(version)
        self.weight_version = self.weight_version + 1 if version is None else version

    def memory_bytes(self, num_requests, num_groups, longest_prompt):
        return 0


def test_weight_sync_sends_every_k_versions_and_never_keeps_an_evaluations_weights():
    be = Loads()
    sync = WeightSync(be, every=2)
    for version in range(5):
        if sync.due(version):
            sync.load(object(), version)
    assert be.loads == [0, 2, 4]
    be.load_params(object())  # an evaluation's load, unversioned: version 5
    assert sync.due(5)  # one version after the last sync, but the backend holds other weights
    sync.load(object(), 5)
    assert not sync.due(6) and sync.due(7) and sync.due(None)  # None: always loaded
    assert be.loads == [0, 2, 4, None, 5]
    with pytest.raises(ValueError, match="every=0"):
        WeightSync(be, every=0)


def test_the_interface_gives_do_nothing_defaults():
    be = Loads()
    assert be.session(4, 32) is None and be.metrics() == {} and be.weight_bytes() == 0
    assert be.precompile([[1]]) is None and be.close() is None
    assert (be.weight_version, be.compiles, be.last_compile) == (-1, 0, "")
    with pytest.raises(TypeError, match="abstract"):
        type("Bare", (RolloutBackend,), {})()  # generate, load_params, memory_bytes required
    assert dataclasses.is_dataclass(backends.BackendSpec)
