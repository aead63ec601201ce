"""The trainer contract (jaxrl/trainers/algorithm.py; docs/architecture.md, "The trainer
contract"): the registry covers every ``algorithm:`` name with a class implementing it, PPO is
GRPO's rollouts composed with a critic stage (not a GRPOTrainer subclass), ``jaxrl check`` and
the loop use only declared public members, and no code compares algorithm names."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

from jaxrl.config import ALGORITHMS, ConfigError
from jaxrl.config.run import STAGE_SECTIONS
from jaxrl.trainers.algorithm import Algorithm
from jaxrl.trainers.registry import TRAINERS, algorithm_class

ROOT = Path(__file__).resolve().parents[1]
TRAINERS_DIR = ROOT / "jaxrl" / "trainers"


def _declared() -> set[str]:
    """Every member the contract declares: methods, properties and annotated attributes."""
    names = {n for n in dir(Algorithm) if not n.startswith("_")}
    for cls in Algorithm.__mro__:
        names |= set(getattr(cls, "__annotations__", {}))
    return names


def test_the_registry_maps_every_config_name_to_a_concrete_algorithm():
    assert tuple(TRAINERS) == ALGORITHMS == tuple(STAGE_SECTIONS)
    for name in ALGORITHMS:
        cls = algorithm_class(name)
        assert issubclass(cls, Algorithm), name
        assert not inspect.isabstract(cls), (name, cls.__abstractmethods__)
        assert cls.description == name  # the progress bar names the algorithm
    with pytest.raises(ConfigError, match="has no trainer"):
        algorithm_class("reinforce")


def test_ppo_composes_grpo_rollouts_with_a_critic_stage():
    from jaxrl.trainers.grpo import GRPOTrainer, RolloutTrainer, Stage
    from jaxrl.trainers.ppo import CriticStage, PPOTrainer

    assert not issubclass(PPOTrainer, GRPOTrainer)
    assert issubclass(PPOTrainer, RolloutTrainer) and issubclass(GRPOTrainer, RolloutTrainer)
    assert issubclass(CriticStage, Stage)
    # the stage overrides only what Stage declares, and PPOTrainer adds no hook of its own
    stage_api = {n for n in vars(Stage) if not n.startswith("_")}
    assert {n for n in vars(CriticStage) if not n.startswith("_")} <= stage_api
    assert not {n for n in vars(PPOTrainer) if n.startswith("_") and n != "__init__"} - {
        "__module__", "__qualname__", "__doc__", "__annotations__", "__firstlineno__",
        "__static_attributes__", "__abstractmethods__", "_abc_impl",
    }  # fmt: skip
    # the critic is saved by the declared checkpoint hook, not as host_state's side effect
    host = inspect.getsource(RolloutTrainer.host_state)
    assert "save" not in host and "stage" not in host


def _private_uses(path: Path) -> list[str]:
    """``obj._name`` reads of another object's private members (``self._x`` is the object's
    own) and imports of private names."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            if not node.attr.startswith("__") and not (
                isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            ):
                out.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
        if isinstance(node, ast.ImportFrom):
            out += [f"{path.name}:{node.lineno}: {a.name}" for a in node.names if a.name[0] == "_"]
    return out


def test_check_uses_the_contract_only():
    source = TRAINERS_DIR / "check" / "__init__.py"
    text = source.read_text()
    assert not re.search(r"SLF001|_started\b", text)
    assert _private_uses(source) == []
    # every member check calls on a trainer is declared on the contract
    used = set(re.findall(r"\b(?:trainer|first|second)\.([a-z_]+)", text))
    assert used and used <= _declared(), used - _declared()


def test_the_loop_uses_declared_members_only():
    tree = ast.parse((TRAINERS_DIR / "algorithm.py").read_text())
    algorithm = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Algorithm")
    used = {
        node.attr
        for node in ast.walk(algorithm)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id in ("self", "cls")
    }
    assert used <= _declared(), used - _declared()


# Layers below trainers/ ask the config what an algorithm does (RunConfig.samples_rollouts,
# .trains_critic, .stage), never its name.
NAME_COMPARE = re.compile(r"algorithm (==|!=|in|not in) |== \"(grpo|ppo|dpo|kto|sft)\"")
ALLOWED = {"config"}  # config: validation and the names' one list


def test_no_code_compares_algorithm_names_outside_config_and_the_registry():
    found = []
    for path in sorted((ROOT / "jaxrl").rglob("*.py")):
        rel = path.relative_to(ROOT / "jaxrl").as_posix()
        if rel.split("/")[0] in ALLOWED or rel in ALLOWED or rel == "trainers/registry.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if NAME_COMPARE.search(line) and not re.search(r"\bkind\b|loss_type", line):
                found.append(f"{rel}:{n}: {line.strip()}")
    assert not found, "\n".join(found)
