"""One vLLM server over HTTP: every call with a timeout, every failure one line.

Standard library only (``urllib``), so the protocol has no dependency and a stub server in the
test suite can serve it. The calls are the ones of vLLM's OpenAI server with
``VLLM_SERVER_DEV_MODE=1`` (docs/rollout.md, "vLLM"): ``/health``, ``/v1/models``,
``/server_info``, ``/v1/completions``, and the weight update ``/pause?mode=wait`` →
``/update_weight_version`` ("updating") → ``/collective_rpc`` ``reload_weights`` →
``/reset_prefix_cache`` → ``/update_weight_version`` (the new version) → ``/resume``;
``/weight_info`` reads the version back.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

__all__ = ["ServerClient", "VLLMError"]

DEV_MODE_FIX = (
    "start the server with VLLM_SERVER_DEV_MODE=1 (jaxrl's weight sync uses its /pause, "
    "/collective_rpc and /update_weight_version routes)"
)


class VLLMError(RuntimeError):
    """A vLLM server failed or answered wrongly; the message is one line naming the URL, the
    call and the fix (the CLI prints it and exits 1)."""


class ServerClient:
    """The HTTP calls jaxrl makes to one server at ``url`` (``http://host:port``); each waits
    at most ``timeout`` seconds."""

    def __init__(self, url: str, timeout: float):
        self.url = url.rstrip("/")
        self.timeout = float(timeout)

    def __repr__(self) -> str:
        return f"ServerClient({self.url!r})"

    # -- transport ----------------------------------------------------------------------------
    def call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        timeout: float | None = None,
        fix: str = "",
        expect_json: bool = True,
    ) -> Any:
        """``method path`` with a JSON ``body``; the decoded JSON answer (None for an empty
        one). Raises :class:`VLLMError` (one line) on a refused or dropped connection, a
        timeout, an HTTP error or an answer that is not JSON."""
        timeout = self.timeout if timeout is None else timeout
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path,
            data=data,
            method=method,
            headers={"Content-Type": "application/json"} if data is not None else {},
        )
        where = f"vLLM server {self.url}: {method} {path.split('?')[0]}"
        start = time.monotonic()
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as e:
            detail = _error_detail(e)
            raise VLLMError(
                f"{where} answered HTTP {e.code}{detail}; "
                f"{fix or 'check the server log (it may have died or run out of memory)'}"
            ) from None
        except TimeoutError:
            raise VLLMError(
                f"{where} gave no answer within rollout.vllm.timeout={timeout:g} s; the server "
                "hangs or is overloaded: check it, or raise rollout.vllm.timeout"
            ) from None
        except (urllib.error.URLError, ConnectionError, http.client.HTTPException, OSError) as e:
            reason = getattr(e, "reason", e)
            if isinstance(reason, TimeoutError):
                raise VLLMError(
                    f"{where} gave no answer within rollout.vllm.timeout={timeout:g} s; the "
                    "server hangs or is overloaded: check it, or raise rollout.vllm.timeout"
                ) from None
            took = time.monotonic() - start
            raise VLLMError(
                f"{where} failed after {took:.1f} s ({type(reason).__name__}: "
                f"{_one_line(reason)}); the server is down or unreachable: start it (or check "
                "rollout.vllm.url)"
            ) from None
        if not raw.strip():
            return None
        try:
            return json.loads(raw)
        except ValueError:
            if not expect_json:
                return raw.decode(errors="replace")
            raise VLLMError(
                f"{where} answered something that is not JSON ({_one_line(raw[:80])!s}); "
                "check that rollout.vllm.url points at a vLLM server"
            ) from None

    # -- the calls ----------------------------------------------------------------------------
    def health(self, timeout: float | None = None) -> None:
        self.call("GET", "/health", timeout=timeout, expect_json=False)

    def models(self) -> list[dict[str, Any]]:
        """``/v1/models``'s ``data`` (``id``, ``max_model_len``, ...)."""
        answer = self.call("GET", "/v1/models")
        data = answer.get("data") if isinstance(answer, dict) else None
        if not isinstance(data, list) or not data:
            raise VLLMError(
                f"vLLM server {self.url}: GET /v1/models lists no model; check that "
                "rollout.vllm.url points at a vLLM server"
            )
        return data

    def server_config(self) -> dict[str, Any]:
        """The server's vLLM config (``/server_info?config_format=json``, dev mode)."""
        answer = self.call(
            "GET",
            "/server_info?config_format=json",
            timeout=max(self.timeout, 60.0),  # its first call collects the system's details
            fix=DEV_MODE_FIX,
        )
        config = answer.get("vllm_config") if isinstance(answer, dict) else None
        return config if isinstance(config, dict) else {}

    def completions(self, body: dict[str, Any]) -> dict[str, Any]:
        answer = self.call(
            "POST",
            "/v1/completions",
            body,
            fix="the request was refused: check that the server runs the run's model "
            "(vocabulary, max_model_len) and the server log",
        )
        if not isinstance(answer, dict):
            raise VLLMError(
                f"vLLM server {self.url}: POST /v1/completions answered {type(answer).__name__}"
                ", not a completion; check that rollout.vllm.url points at a vLLM server"
            )
        return answer

    def weight_version(self) -> str | None:
        answer = self.call("GET", "/weight_info", fix=DEV_MODE_FIX)
        version = answer.get("weight_version") if isinstance(answer, dict) else None
        return None if version is None else str(version)

    def set_weight_version(self, version: str) -> None:
        self.call("POST", "/update_weight_version", {"new_version": version}, fix=DEV_MODE_FIX)

    def reload_weights(self, path: str, version: str) -> None:
        """The disk path: the server loads the checkpoint at ``path`` into the running model
        (``/collective_rpc reload_weights``), inside :meth:`update_weights`."""
        self.update_weights(
            lambda: self.call(
                "POST",
                "/collective_rpc",
                {
                    "method": "reload_weights",
                    "kwargs": {"weights_path": path, "is_checkpoint_format": True},
                },
                fix="the server could not load the weights jaxrl wrote: it must serve the "
                "run's architecture and vocabulary (and see them at the same path: run it on "
                "this machine or share the directory)",
            ),
            version,
        )

    def update_weights(self, load: Callable[[], Any], version: str) -> None:
        """Pause (after the requests in flight), ``load()`` the new weights into the running
        model (a reload from disk, or a GPU weight transfer), drop the prefix cache (its keys
        and values are the old weights'), tag the server with ``version``, resume. Until then
        its version reads ``"updating"``, so a half-done update is never taken for a finished
        one."""
        self.call("POST", "/pause?mode=wait", fix=DEV_MODE_FIX)
        self.set_weight_version("updating")
        load()
        self.call("POST", "/reset_prefix_cache", fix=DEV_MODE_FIX)
        self.set_weight_version(version)
        self.call("POST", "/resume", fix=DEV_MODE_FIX)


def _one_line(x: Any) -> str:
    return " ".join(str(x).split())[:200]


def _error_detail(e: urllib.error.HTTPError) -> str:
    try:
        raw = e.read()
    except OSError:
        return ""
    try:
        body = json.loads(raw)
        message = body.get("message") or body.get("error") or body.get("detail") or body
        if isinstance(message, dict):
            message = message.get("message", message)
    except (ValueError, AttributeError):
        message = raw.decode(errors="replace")
    text = _one_line(message)
    return f" ({text})" if text else ""
