"""Runs at the start of every Python process of a vLLM server jaxrl starts (``api_server.py``
puts this folder first on the server's ``PYTHONPATH``, which every process it starts inherits).

It hides the packages ``JAXRL_VLLM_HIDE`` names (comma-separated; ``api_server.py`` sets it to
the list it resolved) with ``sys.modules[name] = None``: ``importlib.util.find_spec`` answers
"not installed" and ``import`` raises ImportError. This has to happen at interpreter start, in
each process: vLLM inspects a model's architecture in a fresh interpreter (``python -m
vllm.model_executor.models.registry``, when its ``modelinfos`` cache misses, as on a fresh
machine), whose ``import transformers`` imports the CUDA-only torchvision wheel when
``find_spec`` finds it; a stub package on the path would not do (``find_spec`` would find it).

It then runs the ``sitecustomize`` it shadows on ``sys.path``, if the environment has one, so the
environment's own start-up code still runs.
"""

import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _hide() -> None:
    for name in os.environ.get("JAXRL_VLLM_HIDE", "").split(","):
        if name.strip():
            sys.modules.setdefault(name.strip(), None)  # type: ignore[arg-type]


def _run_shadowed() -> None:
    """The environment's own ``sitecustomize`` (the next one on ``sys.path``), if any."""
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


_hide()
_run_shadowed()
