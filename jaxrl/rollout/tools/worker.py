"""The tool worker process of ``grpo.tool_isolation=subprocess`` (``jaxrl.rollout.tools.toolbox``).

Run as a script (``python worker.py '{"specs": [...], "memory_limit_mb": N}'``), standard
library only, so it starts fast and imports neither jax nor jaxrl. It limits its own address
space (``RLIMIT_AS``), loads the tool functions the specs name (``"pkg.module:function"``,
``"pkg.module.function"``, ``"file.py:function"``; the parent has already checked them), says
``{"ok": true}``, then answers one JSON line per request ``{"name", "arguments"}`` with
``{"ok": true, "content": str(result)}`` or ``{"ok": false, "kind", "error"}``. What a tool
prints goes to stderr, so it cannot corrupt the replies. The parent kills it at a deadline.
"""

import importlib
import importlib.util
import json
import os
import resource
import sys


def _load(spec):
    path, sep, attr = spec.rpartition(":")
    if sep and path.endswith(".py"):
        module_spec = importlib.util.spec_from_file_location("_jaxrl_tool_file", path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        name, _, attr = spec.partition(":") if ":" in spec else spec.rpartition(".")
        module = importlib.import_module(name)
    obj = module
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    config = json.loads(sys.argv[1])
    replies = sys.stdout
    sys.stdout = sys.stderr  # a tool's prints must not reach the reply channel
    try:
        limit = config.get("memory_limit_mb")
        if limit:
            size = int(limit) * 2**20
            resource.setrlimit(resource.RLIMIT_AS, (size, size))
        tools = {}
        for spec in config["specs"]:
            func = _load(spec)
            tools[func.__name__] = func
    except BaseException as e:
        replies.write(json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}"}) + "\n")
        replies.flush()
        return
    replies.write('{"ok": true}\n')
    replies.flush()
    for line in sys.stdin:
        request = json.loads(line)
        try:
            value = tools[request["name"]](**request["arguments"])
            reply = {"ok": True, "content": value if isinstance(value, str) else str(value)}
        except MemoryError:
            reply = {"ok": False, "kind": "exception", "error": "MemoryError: over the limit"}
        except Exception as e:
            reply = {"ok": False, "kind": "exception", "error": f"{type(e).__name__}: {e}"}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


if __name__ == "__main__":
    main()
