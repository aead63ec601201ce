"""``rollout.vllm``: the vLLM servers of ``rollout.backend: vllm`` (docs/rollout.md, "vLLM")."""

from __future__ import annotations

import dataclasses
from typing import Literal

from jaxrl.config.base import require, require_choice

__all__ = ["VLLMConfig"]

WEIGHT_TRANSFERS = ("disk", "nccl", "ipc")


@dataclasses.dataclass(frozen=True, kw_only=True)
class VLLMConfig:
    """vLLM servers generating GRPO's rollouts (``rollout.backend: vllm``): given by URL, or
    started and stopped by jaxrl (``command``, else the installed ``vllm`` package)."""

    url: str | list[str] | None = None  # running servers (http://host:port), one or a list:
    # requests are spread over them; None = jaxrl starts one on 127.0.0.1 and stops it
    command: list[str] | None = None  # argv of the server jaxrl starts (run as given; the
    # exported weights' directory replaces {model}, the port {port}); None = the installed vllm
    timeout: float = 60.0  # seconds any one HTTP call to a server may take before the run stops
    start_timeout: float = 600.0  # seconds a server jaxrl starts may take to become healthy
    dtype: str = "float32"  # the dtype of the weights jaxrl writes and a started server runs
    kv_cache_gb: float = 1.0  # VLLM_CPU_KVCACHE_SPACE of a started server (CPU build)
    extra_args: list[str] = dataclasses.field(default_factory=list)  # more argv for the
    # server jaxrl starts from the installed vllm (e.g. ["--max-num-seqs", "256"])
    verify: bool = True  # after each weight sync, check every server's log-probs of a probe
    # sequence against jaxrl's scorer on the weights sent (a stale or wrong model is an error)
    weight_transfer: Literal["disk", "nccl", "ipc"] = "disk"  # how weights reach the servers:
    # a checkpoint on disk they reload (anywhere), or vLLM's NCCL / CUDA-IPC weight-transfer
    # engines fed by DLPack (GPU only; docs/rollout.md, "GPU weight transfer")

    def __post_init__(self):
        urls = [self.url] if isinstance(self.url, str) else list(self.url or [])
        for u in urls:
            require(
                isinstance(u, str) and u.startswith(("http://", "https://")),
                "rollout.vllm.url",
                self.url,
                "give http://host:port of a running vLLM server, a list of them, or leave it "
                "out to let jaxrl start one",
            )
        if self.url is not None:
            require(bool(urls), "rollout.vllm.url", self.url, "give at least one server URL")
        require(
            self.url is None or self.command is None,
            "rollout.vllm.command",
            self.command,
            "give rollout.vllm.url (servers you run) or rollout.vllm.command (a server jaxrl "
            "starts), not both",
        )
        if self.command is not None:
            require(
                bool(self.command) and all(isinstance(a, str) and a for a in self.command),
                "rollout.vllm.command",
                self.command,
                "give the server's argv as a list of strings, e.g. [python, -m, "
                "vllm.entrypoints.openai.api_server, --model, '{model}', --port, '{port}']",
            )
        for name in ("timeout", "start_timeout", "kv_cache_gb"):
            value = getattr(self, name)
            require(value > 0, f"rollout.vllm.{name}", value, "use a positive number")
        require_choice("rollout.vllm.weight_transfer", self.weight_transfer, WEIGHT_TRANSFERS)
        require(
            self.dtype in ("float32", "bfloat16", "float16"),
            "rollout.vllm.dtype",
            self.dtype,
            "use float32, bfloat16 or float16",
        )

    @property
    def urls(self) -> list[str]:
        """The servers' base URLs, without a trailing slash (empty: jaxrl starts one)."""
        urls = [self.url] if isinstance(self.url, str) else list(self.url or [])
        return [u.rstrip("/") for u in urls]
