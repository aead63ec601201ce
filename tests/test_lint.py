"""The tree is ruff-clean (lint and format, line length 100), so style is checked in CI."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("args", [["check", "."], ["format", "--check", "."]])
def test_ruff(args):
    """Through the interpreter under test (``python -m ruff``), not a ``ruff`` found on PATH: a
    venv's pytest run without activating the venv (a scheduler, an IDE) has no PATH to it."""
    found = subprocess.run([sys.executable, "-m", "ruff", "--version"], capture_output=True)
    assert found.returncode == 0, "ruff is part of the test extra: pip install -e '.[test]'"
    result = subprocess.run(
        [sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


# -- one shape vocabulary (docs/shapes.md) -----------------------------------------------------
SHAPES = ROOT / "docs" / "shapes.md"
# a lower-case name, then ``_`` and a capital letter: the shape suffix (``logits_BTV``)
SHAPED_NAME = re.compile(r"\b([a-z][A-Za-z0-9]*(?:_[a-z0-9]+)*)_([A-Z][A-Za-z0-9]*)\b")
NOT_SHAPES = {"lora_A", "lora_B"}  # PEFT's parameter names, not shapes


def shape_symbols() -> list[str]:
    """The symbols of docs/shapes.md's table, in table order."""
    return re.findall(r"^\| `([A-Z][a-z]*)` \|", SHAPES.read_text(), re.M)


def undefined_symbols(suffix: str, symbols: list[str]) -> list[str]:
    """The capital-led symbols of ``suffix`` that ``symbols`` lacks. A defined symbol is matched
    longest first (``Hg`` before ``H``); lower-case letters left over are sizes local to one
    function (``b``, ``bq``) and digits broadcast axes, as docs/shapes.md says."""
    longest_first = sorted(symbols, key=len, reverse=True)
    missing, i = [], 0
    while i < len(suffix):
        if not suffix[i].isupper():
            i += 1
            continue
        symbol = next((s for s in longest_first if suffix.startswith(s, i)), None)
        if symbol is None:
            symbol = re.match(r"[A-Z][a-z]*", suffix[i:]).group()
            missing.append(symbol)
        i += len(symbol)
    return missing


def test_shape_table_gives_each_symbol_one_meaning():
    symbols = shape_symbols()
    assert len(symbols) > 20, "docs/shapes.md's table was not found"
    assert len(symbols) == len(set(symbols)), f"a symbol defined twice: {sorted(symbols)}"


def test_suffix_scan_finds_undefined_symbols():
    assert undefined_symbols("BKHgTL", ["B", "K", "H", "Hg", "T", "L"]) == []
    assert undefined_symbols("BbXq1Yv", ["B"]) == ["Xq", "Yv"]


def test_every_shape_suffix_letter_is_in_docs_shapes():
    symbols = shape_symbols()
    unknown = []
    for path in sorted(ROOT.glob("jaxrl/**/*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for match in SHAPED_NAME.finditer(line):
                if match.group(0) in NOT_SHAPES:
                    continue
                for symbol in undefined_symbols(match.group(2), symbols):
                    unknown.append(f"{path.relative_to(ROOT)}:{n}: {match.group(0)} ({symbol})")
    assert not unknown, "shape symbols docs/shapes.md does not define:\n" + "\n".join(unknown)


def test_no_package_holds_more_than_12_modules():
    crowded = {
        str(d.relative_to(ROOT)): n
        for d in [ROOT / "jaxrl", *(ROOT / "jaxrl").rglob("*")]
        if d.is_dir() and (n := len(list(d.glob("*.py")))) > 12
    }
    assert not crowded, f"split these packages (modules incl. __init__.py): {crowded}"


def test_trainers_orchestrate_in_short_methods():
    """The GRPO family's trainer only orchestrates (issues 33, 50): trainers/grpo/trainer.py
    holds at most 350 lines (the family's loop for GRPO and PPO; its rollout side is in the
    modules beside it) and no function or method anywhere in trainers/ runs over 60 lines
    (docstring included)."""
    import ast

    trainers = ROOT / "jaxrl" / "trainers"
    assert len((trainers / "grpo" / "trainer.py").read_text().splitlines()) <= 350
    long = []
    for path in sorted(trainers.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > 60:
                    long.append(f"{path.name}:{node.name} ({length} lines)")
    assert not long, long


def test_the_public_api_paths_exist():
    """The names the public API fixes (DESIGN: acceptance checks import exactly these) survive
    any move of the modules behind them."""
    from jaxrl.data import schedule
    from jaxrl.data.batching import schedule as impl

    assert schedule.build_dp_schedule is impl.build_dp_schedule
    assert issubclass(schedule.ScheduleError, ValueError)
    from jaxrl import DPOConfig, GRPOConfig, SFTConfig  # noqa: F401
    from jaxrl.data import load_tokenizer  # noqa: F401
    from jaxrl.losses import dpo_loss, grpo_advantages  # noqa: F401
    from jaxrl.models import from_pretrained, lm_head, save_pretrained  # noqa: F401

    c = GRPOConfig(per_device_train_batch_size=8, num_generations=4, world_size=2)
    assert (c.generation_batch_size, c.steps_per_generation) == (16, 1)  # resolved values


# -- state has names (docs/architecture.md: loop carries are registered dataclasses) ----------
LOOP_INIT_ARG = {"while_loop": 2, "fori_loop": 3, "scan": 1}  # positional index of the carry
LOOP_BODY_ARGS = {"while_loop": ((0, 0), (1, 0)), "fori_loop": ((2, 1),), "scan": ((0, 0),)}
CARRY_NAMES = {"c", "carry", "state", "st", "loop_state", "loop_carry", "init", "val"}
NAMED_STATE_PACKAGES = ("jaxrl/train", "jaxrl/generate")


def _loop_kind(call) -> str | None:
    """``while_loop`` / ``fori_loop`` / ``scan`` for a call of ``lax.<kind>`` (any prefix)."""
    import ast

    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    return name if name in LOOP_INIT_ARG else None


def _int_index(node) -> int | None:
    """The integer a subscript's index is (``x[2]``, ``x[-1]``), else None."""
    import ast

    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        value = _int_index(node.operand)
        return None if value is None else -value
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    return None


def _returned(fn) -> list:
    """The expressions a function (a ``def``'s returns, a lambda's body) returns."""
    import ast

    if isinstance(fn, ast.Lambda):
        return [fn.body]
    return [r.value for r in ast.walk(fn) if isinstance(r, ast.Return) and r.value is not None]


def positional_state(source: str) -> list[str]:
    """Where ``source`` treats loop state as a positional tuple: an integer subscript of a
    carry-named variable (``c[2]``) or of a loop body's carry parameter, a carry-named variable
    unpacked into a tuple (``i, carry = state``), a tuple literal as a loop's initial carry, or a
    ``while_loop`` / ``fori_loop`` body returning one."""
    import ast

    tree = ast.parse(source)
    defs: dict[str, list] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            defs.setdefault(node.name, []).append(node)
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and (kind := _loop_kind(node))):
            continue
        at = LOOP_INIT_ARG[kind]
        init = node.args[at] if len(node.args) > at else None
        init = next((k.value for k in node.keywords if k.arg in ("init", "init_val")), init)
        if isinstance(init, ast.Tuple):
            found.append(f"line {node.lineno}: a tuple as the {kind} carry")
        for fn_at, param_at in LOOP_BODY_ARGS[kind]:
            if len(node.args) <= fn_at:
                continue
            fn = node.args[fn_at]
            bodies = [fn] if isinstance(fn, ast.Lambda) else defs.get(getattr(fn, "id", ""), [])
            for body in bodies:
                params = [a.arg for a in body.args.args]
                carry = params[param_at] if len(params) > param_at else None
                for sub in ast.walk(body):
                    if (
                        isinstance(sub, ast.Subscript)
                        and isinstance(sub.value, ast.Name)
                        and sub.value.id == carry
                        and _int_index(sub.slice) is not None
                    ):
                        found.append(f"line {sub.lineno}: {carry}[{_int_index(sub.slice)}]")
                if kind != "scan" and any(isinstance(r, ast.Tuple) for r in _returned(body)):
                    found.append(f"line {body.lineno}: a {kind} body returns a tuple")
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Subscript)
            and isinstance(node.value, ast.Name)
            and node.value.id in CARRY_NAMES
            and _int_index(node.slice) is not None
        ):
            found.append(f"line {node.lineno}: {node.value.id}[{_int_index(node.slice)}]")
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Name)
            and node.value.id in CARRY_NAMES
            and any(isinstance(t, ast.Tuple) for t in node.targets)
        ):
            found.append(f"line {node.lineno}: {node.value.id} unpacked as a tuple")
    return sorted(set(found))


def test_positional_state_scan_finds_tuple_carries():
    """The scan finds what the accumulator's loop looked like before its state had names."""
    before = """
def rounds(add, init, total_of):
    def cond(state):
        i, carry = state
        return (i < stop) & (total_of(carry) < docs_per_step)

    def body(state):
        i, carry = state
        return i + 1, add(carry, i)

    return jax.lax.while_loop(cond, body, (start, init))

def add(carry, i):
    grads, total = carry
    return grads + g, total + n

end, carry = rounds(add, (zero, jnp.int32(0)), lambda c: c[1])
out = lax.fori_loop(0, n, lambda j, v: (v[0] + j, v[1]), x)
"""
    found = positional_state(before)
    assert any("tuple as the while_loop carry" in f for f in found), found
    assert any("state unpacked" in f for f in found) and any("carry unpacked" in f for f in found)
    assert any("c[1]" in f for f in found) and any("v[0]" in f for f in found), found
    assert any("while_loop body returns a tuple" in f for f in found), found
    named = """
def body(state: Rounds) -> Rounds:
    return Rounds(cursor=state.cursor + 1, sums=add(state.sums, state.cursor))

out = jax.lax.while_loop(lambda s: s.cursor < stop, body, Rounds(cursor=start, sums=init))
carry, ys = jax.lax.scan(lambda c, x: (c + x, c), init, xs)
"""
    assert positional_state(named) == []


def test_no_tuple_indexing_of_loop_state():
    """Loop carries in train/ and generate/ are registered dataclasses read by name, never
    positional tuples read as ``carry[3]`` (issue 50, item 3)."""
    found = []
    for package in NAMED_STATE_PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found += [f"{path.relative_to(ROOT)}: {f}" for f in positional_state(path.read_text())]
    assert not found, "positional loop state:\n" + "\n".join(found)
