"""Tools a policy calls during a GRPO episode: loading, schemas, parsing calls, running them.

TRL's conventions (docs/tools.md):

- a **tool** is a Python function with type hints and a Google-style docstring; its JSON schema
  (``jaxrl.rollout.tools.schema``) reaches the chat template's ``tools=`` argument. ``grpo.tools``
  names them like reward functions: ``"pkg.module:function"`` or ``"path/to/file.py:function"``
  (or callables from Python);
- an **environment** (``grpo.environment``, TRL's ``environment_factory``) is a class built once
  per episode; ``reset(**row)`` receives the dataset row, and its public methods (not ``reset``,
  not ``get_reward``, not starting with ``_``) are tools bound to that episode's state;
- a **tool call** is found in the model's text by a parser (``jaxrl.rollout.tools.calls``:
  Qwen2.5 / Hermes ``<tool_call>{...}</tool_call>`` blocks by default, ``grpo.tool_parser``);
- a tool's **result** is ``str(value)`` (TRL), in a ``{"role": "tool", "name", "content"}``
  message. A malformed call, an unknown tool, arguments that do not fit the signature, an
  exception, a timeout or a crashed tool process becomes the message ``str({"error": ...})``
  (TRL's form), counted as a failure; nothing a tool does stops the run.

Isolation (``grpo.tool_isolation``): ``thread`` (default) calls tools in this process, each
with ``grpo.tool_timeout`` seconds (``jaxrl.runtime.timeout``: a call past its deadline is
reported to the model and left running in a daemon thread, which cannot be stopped);
``subprocess`` runs the ``grpo.tools`` functions in a worker process (``worker.py``) with an
address-space limit (``grpo.tool_memory_limit_mb``), killed and restarted when a call passes its
deadline. Environment methods always run in-process (their state lives here).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import select
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from jaxrl.config.base import ConfigError, config_error
from jaxrl.rollout.rewards.specs import load_named
from jaxrl.rollout.tools.calls import TOOL_PARSERS, HermesToolParser, ToolCall, ToolParser
from jaxrl.rollout.tools.schema import SchemaError, get_json_schema
from jaxrl.runtime.timeout import CallTimeoutError, call_with_deadline

__all__ = [
    "FAILURE_KINDS",
    "ToolResult",
    "Toolbox",
    "load_environment",
    "load_tool_parser",
    "load_tools",
    "toolbox_from_config",
]

# why a call failed: a tool message tells the model, the run counts it (tools/failures)
FAILURE_KINDS = ("malformed", "unknown_tool", "bad_arguments", "exception", "timeout", "crashed")
WORKER = Path(__file__).with_name("worker.py")


@dataclasses.dataclass(frozen=True)
class ToolResult:
    """A call's outcome: the tool message content and why it failed (None: it ran)."""

    name: str
    content: str
    failure: str | None = None  # one of FAILURE_KINDS

    def message(self) -> dict[str, Any]:
        return {"role": "tool", "name": self.name, "content": self.content}


def _error(name: str, kind: str, detail: str) -> ToolResult:
    return ToolResult(name, str({"error": detail}), kind)


def _check_tool(where: str, spec: Any, func: Any) -> dict[str, Any]:
    if not callable(func):
        raise config_error(where, spec, f"it names a {type(func).__name__}, not a function")
    try:
        return get_json_schema(func)
    except SchemaError as e:
        raise config_error(where, spec, f"{e} (a tool needs a schema: docs/tools.md)") from None


def load_tools(specs: Sequence[Any], *, field: str = "grpo.tools") -> list[Callable[..., Any]]:
    """The functions ``grpo.tools`` names (``"pkg.module:function"``, ``"file.py:function"``,
    or callables), each with a usable schema, names unique; ``ConfigError`` otherwise."""
    funcs, names = [], set()
    for i, spec in enumerate(specs):
        where = f"{field}[{i}]"
        func = spec if callable(spec) else load_named(where, spec)
        schema = _check_tool(where, spec, func)
        name = schema["function"]["name"]
        if name in names:
            raise config_error(where, spec, f"a second tool named {name!r}: rename one")
        names.add(name)
        funcs.append(func)
    return funcs


def environment_methods(cls: type) -> list[str]:
    """The tool methods of an environment class: public functions but ``reset``/``get_reward``."""
    return [
        name
        for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
        if not name.startswith("_") and name not in ("reset", "get_reward")
    ]


def load_environment(spec: Any, *, field: str = "grpo.environment") -> type:
    """The class ``grpo.environment`` names; it must define ``reset`` and build without
    arguments, and every tool method must have a schema."""
    cls = spec if isinstance(spec, type) else load_named(field, spec)
    if not isinstance(cls, type):
        raise config_error(field, spec, f"it names a {type(cls).__name__}, not a class")
    if not callable(getattr(cls, "reset", None)):
        raise config_error(field, spec, "an environment class must define reset(self, **row)")
    methods = environment_methods(cls)
    if not methods:
        raise config_error(field, spec, "the class has no public methods, so no tools")
    for name in methods:
        _check_tool(f"{field}.{name}", spec, getattr(cls, name))
    return cls


def load_tool_parser(spec: Any, *, field: str = "grpo.tool_parser") -> ToolParser:
    """A built-in parser name (``hermes``), or an object / class named by a spec with
    ``parse(text) -> ParsedTurn``."""
    if isinstance(spec, str) and spec in TOOL_PARSERS:
        return TOOL_PARSERS[spec]()
    obj = load_named(field, spec) if isinstance(spec, str) else spec
    if isinstance(obj, type):
        obj = obj()
    if not callable(getattr(obj, "parse", None)):
        raise config_error(field, spec, f"use {', '.join(TOOL_PARSERS)} or an object with parse()")
    return obj


class _Worker:
    """The ``subprocess`` isolation: one worker process serving the ``grpo.tools`` functions
    over line-delimited JSON (``worker.py``), restarted after a timeout or a crash."""

    def __init__(self, specs: Sequence[str], memory_limit_mb: int | None):
        self.specs = [str(s) for s in specs]
        self.memory_limit_mb = memory_limit_mb
        self.proc: subprocess.Popen[str] | None = None

    def _start(self) -> subprocess.Popen[str]:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        args = json.dumps({"specs": self.specs, "memory_limit_mb": self.memory_limit_mb})
        proc = subprocess.Popen(
            [sys.executable, str(WORKER), args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=os.getcwd(),
        )
        assert proc.stdout is not None
        ready = json.loads(proc.stdout.readline() or '{"ok": false, "error": "no reply"}')
        if not ready.get("ok"):
            _stop(proc)
            raise ConfigError(
                f"grpo.tool_isolation=subprocess: the tool worker could not load {self.specs}: "
                f"{ready.get('error')}"
            )
        return proc

    def call(self, name: str, arguments: dict[str, Any], timeout: float | None) -> ToolResult:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = self._start()
        proc = self.proc
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(json.dumps({"name": name, "arguments": arguments}) + "\n")
            proc.stdin.flush()
        except (BrokenPipeError, TypeError, ValueError) as e:
            self.close()
            return _error(name, "crashed", f"{name} could not be called: {e}")
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        if not ready:
            self.close()
            return _error(name, "timeout", f"{name} did not return within {timeout:g} s")
        line = proc.stdout.readline()
        if not line:
            code = _stop(proc)
            self.proc = None
            return _error(name, "crashed", f"the tool process died running {name} (exit {code})")
        reply = json.loads(line)
        if reply["ok"]:
            return ToolResult(name, reply["content"])
        return _error(name, reply.get("kind", "exception"), reply["error"])

    def close(self) -> None:
        if self.proc is not None:
            _stop(self.proc)
            self.proc = None


def _stop(proc: subprocess.Popen[str]) -> int:
    """Kill a worker (if still running), reap it and close its pipes; its exit code."""
    proc.kill()
    code = proc.wait()
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            try:
                pipe.close()
            except BrokenPipeError:
                pass
    return code


class Toolbox:
    """The run's tools and environment: schemas for the chat template, per-episode functions,
    and :meth:`run` (module docstring). ``tools``: functions (``load_tools``); ``specs``: their
    config entries (needed for ``isolation="subprocess"``); ``environment``: a class
    (``load_environment``) or None."""

    def __init__(
        self,
        tools: Sequence[Callable[..., Any]] = (),
        *,
        environment: type | None = None,
        parser: ToolParser | None = None,
        timeout: float | None = 10.0,
        isolation: str = "thread",
        memory_limit_mb: int | None = None,
        specs: Sequence[Any] | None = None,
    ):
        self.tools = list(tools)
        self.environment = environment
        self.parser = parser or HermesToolParser()
        self.timeout = timeout
        self.isolation = isolation
        schemas = [get_json_schema(f) for f in self.tools]
        if environment is not None:
            schemas += [get_json_schema(getattr(environment, m)) for m in self.method_names]
        names = [s["function"]["name"] for s in schemas]
        if len(set(names)) != len(names):
            raise ConfigError(f"grpo.tools and grpo.environment define a tool twice: {names}")
        if not names:
            raise ConfigError("a tool run needs grpo.tools or grpo.environment")
        self.schemas = schemas
        self.names = names
        self._functions = dict(zip(names, self.tools, strict=False))  # the plain tools
        self._worker = None
        if isolation == "subprocess" and self.tools:
            if specs is None or any(not isinstance(s, str) for s in specs):
                raise ConfigError(
                    "grpo.tool_isolation=subprocess loads the tools in a worker process by their "
                    "config entries ('pkg.module:function' or 'file.py:function'), not callables"
                )
            self._worker = _Worker(specs, memory_limit_mb)

    @property
    def method_names(self) -> list[str]:
        return environment_methods(self.environment) if self.environment is not None else []

    def reward_funcs(self) -> list[Callable[..., Any]]:
        """TRL: an environment class with ``get_reward()`` adds a reward function (named after
        the class) returning each episode's ``env.get_reward()``."""
        cls = self.environment
        if cls is None or not callable(getattr(cls, "get_reward", None)):
            return []

        def get_reward(environments: Sequence[Any], **kwargs: Any) -> list[float]:
            return [env.get_reward() for env in environments]

        get_reward.__name__ = cls.__name__
        return [get_reward]

    def new_episode(self, row: Mapping[str, Any]) -> tuple[Any, dict[str, Callable[..., Any]]]:
        """``(environment instance or None, name → function)`` for one episode; ``reset(**row)``
        gets the dataset row (its prompt and every column)."""
        functions = dict(self._functions)
        env = None
        if self.environment is not None:
            env = self.environment()
            env.reset(**row)
            functions.update({m: getattr(env, m) for m in self.method_names})
        return env, functions

    def run(self, call: ToolCall, functions: Mapping[str, Callable[..., Any]]) -> ToolResult:
        """Run one parsed call; every failure is a tool message (module docstring)."""
        name = call.name
        func = functions.get(name)
        if func is None:
            known = ", ".join(sorted(functions))
            return _error(name, "unknown_tool", f"unknown tool {name!r}; the tools are {known}")
        try:
            inspect.signature(func).bind(**call.arguments)
        except TypeError as e:
            return _error(name, "bad_arguments", f"{name}: {e}")
        in_env = self.environment is not None and name in self.method_names
        if self._worker is not None and not in_env:
            return self._worker.call(name, call.arguments, self.timeout)
        try:
            value = call_with_deadline(
                lambda: func(**call.arguments), self.timeout, name=f"tool {name!r}"
            )
        except CallTimeoutError:
            return _error(name, "timeout", f"{name} did not return within {self.timeout:g} s")
        except Exception as e:
            return _error(name, "exception", f"{type(e).__name__}: {e}")
        return ToolResult(name, value if isinstance(value, str) else str(value))

    def close(self) -> None:
        """Stop the worker process, if any."""
        if self._worker is not None:
            self._worker.close()


def toolbox_from_config(config: Any) -> Toolbox:
    """The ``Toolbox`` of a ``GRPOConfig`` with ``tools`` or ``environment`` (user code is
    imported here, when the run starts)."""
    specs = list(config.tools or ())
    return Toolbox(
        load_tools(specs),
        environment=(
            load_environment(config.environment) if config.environment is not None else None
        ),
        parser=load_tool_parser(config.tool_parser),
        timeout=config.tool_timeout,
        isolation=config.tool_isolation,
        memory_limit_mb=config.tool_memory_limit_mb,
        specs=specs,
    )
