"""``rollout.backend: vllm``: GRPO rollouts from vLLM servers (docs/rollout.md, "vLLM")."""

from jaxrl.rollout.vllm.backend import VLLMBackend, export_weights
from jaxrl.rollout.vllm.client import ServerClient, VLLMError
from jaxrl.rollout.vllm.server import LocalServer, live_servers

__all__ = [
    "LocalServer",
    "ServerClient",
    "VLLMBackend",
    "VLLMError",
    "export_weights",
    "live_servers",
]
