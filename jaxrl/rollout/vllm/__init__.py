"""``rollout.backend: vllm``: GRPO rollouts from vLLM servers (docs/rollout.md, "vLLM")."""

from jaxrl.rollout.vllm.backend import VLLMBackend
from jaxrl.rollout.vllm.client import ServerClient, VLLMError
from jaxrl.rollout.vllm.server import LocalServer, live_servers
from jaxrl.rollout.vllm.weights import export_weights

__all__ = [
    "LocalServer",
    "ServerClient",
    "VLLMBackend",
    "VLLMError",
    "export_weights",
    "live_servers",
]
