"""``rollout.backend: vllm``: the rollout interface served by one or more vLLM servers.

:class:`VLLMBackend` implements :class:`jaxrl.generate.backend.RolloutBackend` over HTTP
(docs/rollout.md, "vLLM"):

- **Servers.** ``rollout.vllm.url`` (one URL or a list: servers someone else runs), or a server
  that jaxrl starts on 127.0.0.1 from ``rollout.vllm.command`` or the installed ``vllm`` package
  (``server.py``: owned by PID, stopped on every exit path), on the run's own exported weights.
- **Weights.** ``load_params`` writes the weights in the HF names and layout of jaxrl's exporter
  (``weights.export_weights``, the head untied; LoRA runs pass merged weights) into a fresh
  directory, renamed into place when complete, and every server reloads them (``client.py``),
  whenever it is called with new arrays; the version
  is stored on the server (``/update_weight_version``), tagged with this backend's run id, and
  read back before every generation, so a server that restarted, was updated by someone else or
  stopped half-way through an update is an error, never a silent source of samples. After each
  sync every server scores a probe sequence, which must match jaxrl's scorer on the weights
  sent (``rollout.vllm.verify``). Given the same arrays again, nothing is sent. Samples carry
  the version that made them. How often the trainer calls it (``rollout.sync_every``) is the
  trainer's policy (``jaxrl.rollout.weight_sync``).
- **Generation.** ``/v1/completions`` with token ids in and out: one request per distinct
  prompt (``n`` = its copies; greedy: one and copies of it), spread round-robin over the
  servers and sent concurrently; the answer's ``token_ids``, ``logprobs.token_logprobs`` and
  ``finish_reason`` become the :class:`SampleResult`. eos ids are sent as ``stop_token_ids``.
  vLLM draws its own random bits: ``key`` is not used, so sampled completions are not
  reproducible from the seed (greedy ones are).
- **Log-probs.** A server's default log-probs are the untempered model's (``raw_logprobs``);
  jaxrl's sampler log-prob is ``log_softmax(logits / T)``. At T ≠ 1 the server must run with
  ``--logprobs-mode processed_logprobs``: checked at connect (``/server_info``), an error
  otherwise. (With top-k / top-p, processed log-probs are renormalised over the kept tokens:
  the sampler's true probabilities, which ``grpo.importance_sampling_correction`` expects.)
- **Failures.** Every call has ``rollout.vllm.timeout``; a refused connection, a timeout, an
  HTTP error, fewer or malformed completions or another version raise :class:`VLLMError`, one
  line naming the URL, the call and the fix.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import math
import os
import shutil
import tempfile
import time
import uuid
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxrl.config.sections.vllm import VLLMConfig
from jaxrl.generate.backend import RolloutBackend
from jaxrl.generate.sampler_weights import sampler_model
from jaxrl.generate.sampling import SampleResult, SamplingParams, stop_token_ids
from jaxrl.models.model_config import ModelConfig
from jaxrl.rollout.vllm.client import ServerClient, VLLMError
from jaxrl.rollout.vllm.server import LocalServer, default_command, free_port
from jaxrl.rollout.vllm.transfer import WeightTransfer, check_cuda
from jaxrl.rollout.vllm.weights import export_weights
from jaxrl.train.score import Scorer

__all__ = ["VLLMBackend"]

MAX_CONCURRENT = 64  # requests in flight per server
PROBE_TOL = 1e-3  # the weight check's mean |Δ log-prob|, both sides fp32


class VLLMBackend(RolloutBackend):
    """Generation by vLLM servers behind the rollout interface (module doc).

    ``config``: the model the servers run (LoRA: the dense one). ``vllm``: the servers and
    their limits (``rollout.vllm``). ``max_model_len``: the longest prompt + completion a
    request may need (a server jaxrl starts is sized for it). ``log_dir``: where a started
    server writes its log. When to sync is the trainer's (``jaxrl.rollout.weight_sync``): every
    ``load_params`` with new arrays is sent.
    """

    def __init__(
        self,
        config: ModelConfig,
        vllm: VLLMConfig,
        *,
        max_new_tokens: int,
        eos_id: int | Sequence[int],
        pad_id: int,
        sampling: SamplingParams | None = None,
        max_model_len: int = 0,
        log_dir: str | os.PathLike[str] | None = None,
    ):
        check_cuda(vllm.weight_transfer)
        self.eos_ids = stop_token_ids("VLLMBackend", config.vocab_size, eos_id, pad_id)
        config, self._graphdef, _ = sampler_model(config)
        self.transfer: WeightTransfer | None = None  # nccl / ipc (transfer.py); None: disk
        if vllm.weight_transfer != "disk":
            self.transfer = WeightTransfer(
                vllm.weight_transfer, config, self._graphdef, dtype=vllm.dtype
            )
        self.config = config
        self.vllm = vllm
        self.max_new_tokens = int(max_new_tokens)
        self.pad_id = int(pad_id)
        self.sampling = sampling or SamplingParams()
        self.max_model_len = int(max_model_len or config.max_position_embeddings)
        self.weight_version = -1
        self.run_id = uuid.uuid4().hex[:12]  # server versions read "<run_id>:<version>"
        self._dir = Path(tempfile.mkdtemp(prefix="jaxrl-vllm-"))
        weakref.finalize(self, shutil.rmtree, self._dir, True)  # also without close()
        self._log_dir = Path(log_dir) if log_dir is not None else self._dir
        self.servers: list[LocalServer] = []
        self.clients = [ServerClient(u, vllm.timeout) for u in vllm.urls]
        self._checked: set[str] = set()  # servers whose config was checked
        self._max_len: dict[str, int] = {}  # each server's max_model_len (0: not known)
        self._leaves: list[Any] | None = None  # the arrays of the version loaded last
        self._scorer: Scorer | None = None  # the post-sync weight check's (vllm.verify)
        self._probe = [(7 * k + 3) % config.vocab_size for k in range(8)]
        self._pool = concurrent.futures.ThreadPoolExecutor(
            MAX_CONCURRENT * max(1, len(self.clients)), thread_name_prefix="jaxrl-vllm"
        )
        self.requests = [0] * max(1, len(self.clients))  # per server, since the last metrics()
        self.sync_s = 0.0
        self.syncs = 0

    # -- weights ------------------------------------------------------------------------------
    def load_params(
        self, params: Any, *, copy: bool | None = None, version: int | None = None
    ) -> None:
        """Send these weights to every server as ``version`` (default: the last + 1); when they
        are the arrays sent last nothing is sent, and the servers' weights only take the new
        version (an evaluation loaded the step's weights first). ``copy`` is unused (the
        servers hold their own copy)."""
        del copy
        if isinstance(params, nnx.Module):
            params = nnx.state(params, nnx.Param)
        leaves = jax.tree.leaves(params)
        same = self._leaves is not None and len(leaves) == len(self._leaves)
        if same and all(a is b for a, b in zip(leaves, self._leaves, strict=True)):
            if version is not None and int(version) != self.weight_version:
                # the weights an evaluation sent are this step's: they take its version
                tag = self._tag(int(version))
                self._each(lambda c: c.set_weight_version(tag))
                self.weight_version = int(version)
            return
        v = self.weight_version + 1 if version is None else int(version)
        start = time.perf_counter()
        tag, path = self._tag(v), None
        if not self.clients:  # the first sync starts jaxrl's own server on these weights
            path = self._export(params, v)
            self._start_server(path, tag)
        elif self.transfer is not None:  # nccl / ipc: one server after the other
            for client in self.clients:
                client.update_weights(lambda c=client: self.transfer.send(c, params), tag)
        else:
            path = self._export(params, v)
            self._each(lambda c: c.reload_weights(str(path), tag))
        if self.vllm.verify:
            self._verify(params)
        for old in self._dir.glob("v*"):
            if old != path:
                shutil.rmtree(old, ignore_errors=True)
        self.weight_version, self._leaves = v, leaves
        self.sync_s += time.perf_counter() - start
        self.syncs += 1

    def _export(self, params: Any, version: int) -> Path:
        """The disk path: ``params`` written as a HF checkpoint for the servers to load."""
        return export_weights(
            self._graphdef,
            params,
            self._dir / f"v{version}",
            dtype=self.vllm.dtype,
            eos_ids=self.eos_ids,
            pad_id=self.pad_id,
        )

    def _verify(self, params: Any) -> None:
        """Every server's log-probs of a fixed probe sequence are jaxrl's scorer's on
        ``params`` (mean |Δ| within ``PROBE_TOL``): the reload took, all of it (a server
        started from a checkpoint with a tied output head keeps the old head: vLLM 0.32)."""
        if self._scorer is None:
            self._scorer = Scorer(self._graphdef, row_len=len(self._probe))
        want = self._scorer.token_logprobs(params, [np.asarray(self._probe, np.int32)])[0][1:]
        body = {
            "prompt": self._probe, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 0.0,
            "return_tokens_as_token_ids": True,
        }  # fmt: skip
        tol = PROBE_TOL if self.vllm.dtype == self.config.dtype == "float32" else 0.1
        answers = self._each(lambda c: c.completions(body))
        for client, answer in zip(self.clients, answers, strict=True):
            try:
                per_token = answer["choices"][0]["prompt_logprobs"]
                got = np.asarray(
                    [per_token[i][str(t)]["logprob"] for i, t in enumerate(self._probe) if i],
                    np.float64,
                )
            except (KeyError, IndexError, TypeError, ValueError):
                raise VLLMError(
                    f"vLLM server {client.url}: POST /v1/completions gave no prompt log-probs "
                    "for the weight check; the server is not a compatible vLLM, or set "
                    "rollout.vllm.verify=false"
                ) from None
            gap = float(np.abs(got - want).mean())
            if not gap <= tol:
                raise VLLMError(
                    f"vLLM server {client.url}: after the weight update its log-probs of a probe "
                    f"differ from jaxrl's by {gap:.3g} on average (> {tol:g}): it serves other "
                    "weights than jaxrl sent. Start it from jaxrl's export (a checkpoint with "
                    "tie_word_embeddings true keeps its old output head in vLLM's reload) of "
                    "the run's model"
                )

    def _tag(self, version: int) -> str:
        return f"{self.run_id}:{version}"

    def _start_server(self, path: Path, tag: str) -> None:
        port = free_port()
        temperature = self.sampling.temperature
        mode = "raw_logprobs" if temperature in (0.0, 1.0) else "processed_logprobs"
        if self.vllm.command is not None:
            command = [
                a.replace("{model}", str(path)).replace("{port}", str(port))
                for a in (self.vllm.command)
            ]
        else:
            command = default_command(
                str(path),
                port,
                dtype=self.vllm.dtype,
                max_model_len=self.max_model_len,
                logprobs_mode=mode,
                extra_args=self.vllm.extra_args,
            )
        env = {
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_CPU_KVCACHE_SPACE": f"{self.vllm.kv_cache_gb:g}",
        }
        if self.transfer is not None and self.vllm.command is None:
            kind = self.transfer.kind
            command += ["--weight-transfer-config", json.dumps({"backend": kind})]
            if kind == "ipc":  # the IPC handles travel pickled over HTTP
                env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        server = LocalServer(
            command, port=port, log_path=self._log_dir / "vllm_server.log", env=env
        )
        self.servers.append(server)
        server.wait_ready(self.vllm.start_timeout)
        self.clients = [ServerClient(server.url, self.vllm.timeout)]
        self.requests = [0]
        self.clients[0].set_weight_version(tag)

    def _each(self, fn: Any) -> list[Any]:
        """``fn(client)`` on every server at once; the first failure is raised."""
        futures = [self._pool.submit(fn, c) for c in self.clients]
        return [f.result() for f in futures]

    def memory_bytes(self, num_requests: int, num_groups: int, longest_prompt: int) -> int:
        """0, the true count on jaxrl's devices (what the interface counts): the KV caches live
        in the servers' processes, sized by vLLM itself (``rollout.vllm.kv_cache_gb`` for a
        server jaxrl starts on CPU, ``--gpu-memory-utilization`` on a GPU), not per call."""
        del num_requests, num_groups, longest_prompt
        return 0

    # -- checks -------------------------------------------------------------------------------
    def _check_server(self, client: ServerClient, sampling: SamplingParams) -> None:
        """Once per server: the log-probs it reports fit the run's temperature, and its model
        takes the run's longest request."""
        key = f"{client.url}:{sampling.temperature}"
        if key in self._checked:
            return
        config = client.server_config()
        model = config.get("model_config") or {}
        mode = model.get("logprobs_mode", "raw_logprobs")
        t = sampling.temperature
        if t not in (0.0, 1.0) and mode == "raw_logprobs":
            raise VLLMError(
                f"vLLM server {client.url}: temperature={t:g} but the server reports "
                f"untempered log-probs (logprobs_mode={mode}), not the sampler's "
                "log_softmax(logits/T): start it with --logprobs-mode processed_logprobs (or "
                "let jaxrl start it: leave rollout.vllm.url out)"
            )
        self._max_len[client.url] = int(model.get("max_model_len") or 0)
        self._checked.add(key)

    def _check_versions(self) -> None:
        """Every server serves this run's current version (else a one-line error)."""
        want = self._tag(self.weight_version)
        versions = self._each(lambda c: c.weight_version())
        for client, got in zip(self.clients, versions, strict=True):
            if got != want:
                what = (
                    "a half-done weight update"
                    if got == "updating"
                    else "weights jaxrl did not send"
                    if got is None or not str(got).startswith(self.run_id)
                    else f"version {str(got).split(':')[-1]}"
                )
                raise VLLMError(
                    f"vLLM server {client.url}: GET /weight_info says {got!r}, not this run's "
                    f"version {want!r} ({what}): the server restarted, another trainer "
                    "updated it, or an update failed; give each run its own servers and "
                    "restart the run (it re-syncs them)"
                )

    # -- generation ---------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        key: jax.Array,
        sampling: SamplingParams | None = None,
        *,
        max_tokens: Sequence[int] | np.ndarray | None = None,
    ) -> SampleResult:
        """One completion per prompt row (the interface's contract; ``key`` is not used:
        vLLM draws its own random bits)."""
        del key
        if self.weight_version < 0:
            raise RuntimeError("VLLMBackend.generate: load_params first (no weights sent yet)")
        b = len(prompts)
        if not b or any(len(p) == 0 for p in prompts):
            raise ValueError("VLLMBackend.generate: need at least one prompt, each with >= 1 token")
        n = self.max_new_tokens
        limits = np.full(b, n, np.int32) if max_tokens is None else np.asarray(max_tokens)
        if limits.shape != (b,) or not ((limits >= 1) & (limits <= n)).all():
            raise ValueError(
                f"VLLMBackend.generate: max_tokens must give one limit in [1, {n}] per prompt "
                f"({b}), got {np.asarray(max_tokens).tolist()}"
            )
        s = sampling or self.sampling
        for client in self.clients:
            self._check_server(client, s)
        self._check_versions()
        groups: dict[tuple[tuple[int, ...], int], list[int]] = {}
        for r, (p, limit) in enumerate(zip(prompts, limits.tolist(), strict=True)):
            groups.setdefault((tuple(int(t) for t in p), int(limit)), []).append(r)
        greedy = s.temperature == 0
        jobs = []
        for g, ((prompt, limit), rows) in enumerate(groups.items()):
            server = g % len(self.clients)
            self.requests[server] += 1
            body = self._body(prompt, limit, 1 if greedy else len(rows), s, server)
            jobs.append((server, rows, limit, self._pool.submit(self._complete, server, body)))
        tokens = np.full((b, n), self.pad_id, np.int32)
        logprobs = np.zeros((b, n), np.float32)
        lengths = np.zeros(b, np.int32)
        truncated = np.zeros(b, bool)
        for server, rows, limit, future in jobs:
            choices = self._parse(server, future.result(), len(rows), limit, greedy)
            for r, (ids, lps, reason) in zip(rows, choices, strict=True):
                tokens[r, : len(ids)], logprobs[r, : len(ids)] = ids, lps
                lengths[r] = len(ids)
                truncated[r] = reason == "length" and ids[-1] not in self.eos_ids
        return SampleResult.of(
            prompts, tokens, logprobs, lengths, truncated, weight_version=self.weight_version
        )

    __call__ = generate

    def _body(
        self, prompt: tuple[int, ...], limit: int, count: int, s: SamplingParams, server: int
    ) -> dict[str, Any]:
        url = self.clients[server].url
        longest = self._max_len.get(url) or (self.max_model_len if self.servers else 0)
        if longest and len(prompt) + limit > longest:
            raise VLLMError(
                f"vLLM server {url}: a prompt of {len(prompt)} tokens plus {limit} new ones "
                f"exceeds its max_model_len={longest}; start it with a larger --max-model-len "
                "(a server jaxrl starts takes schedule.max_tokens)"
            )
        return {
            "model": None,
            "prompt": list(prompt),
            "n": count,
            "max_tokens": limit,
            "temperature": s.temperature,
            "top_k": s.top_k,  # 0 = off, as in jaxrl
            "top_p": s.top_p,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "logprobs": 0,  # the sampled token's log-prob
            "stop_token_ids": list(self.eos_ids),
            "ignore_eos": False,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
        }

    def _complete(self, server: int, body: dict[str, Any]) -> dict[str, Any]:
        client = self.clients[server]
        if body["model"] is None:
            body = {k: v for k, v in body.items() if k != "model"}
        return client.completions(body)

    def _parse(
        self, server: int, answer: dict[str, Any], rows: int, limit: int, greedy: bool
    ) -> list[tuple[list[int], list[float], str]]:
        """The ``rows`` completions of one request's answer, checked."""
        url = self.clients[server].url
        bad = f"vLLM server {url}: POST /v1/completions"
        choices = answer.get("choices")
        want = 1 if greedy else rows
        if not isinstance(choices, list) or len(choices) != want:  # fewer (or more) than asked
            got = len(choices) if isinstance(choices, list) else "no"
            raise VLLMError(
                f"{bad} returned {got} completions for n={want}; the server is not a "
                "compatible vLLM (>= 0.10, token ids in and out) or failed: check its log"
            )
        if not all(isinstance(c, dict) for c in choices):
            raise VLLMError(f"{bad} returned completions that are not objects: check its log")
        out = []
        for choice in sorted(choices, key=lambda c: c.get("index", 0)):
            ids = choice.get("token_ids")
            lps = (choice.get("logprobs") or {}).get("token_logprobs")
            reason = choice.get("finish_reason")
            ok = (
                isinstance(ids, list)
                and 1 <= len(ids) <= limit
                and all(isinstance(t, int) and 0 <= t < self.config.vocab_size for t in ids)
                and isinstance(lps, list)
                and len(lps) == len(ids)
                and all(isinstance(x, int | float) and math.isfinite(x) and x <= 1e-3 for x in lps)
                and reason in ("stop", "length")
            )
            if not ok:
                raise VLLMError(
                    f"{bad} returned a malformed completion (token_ids {str(ids)[:60]}, "
                    f"{len(lps) if isinstance(lps, list) else 'no'} log-probs, finish_reason "
                    f"{reason!r}; vocabulary {self.config.vocab_size}, max_tokens {limit}): the "
                    "server must run the run's model (rollout.vllm.url) and return token ids "
                    "and log-probs"
                )
            out.append((ids, [float(x) for x in lps], reason))
        return out * rows if greedy else out

    # -- metrics and the end ------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """Since the last call: seconds spent sending weights, syncs, and requests per server
        (``vllm/requests_<i>``)."""
        out: dict[str, float] = {"vllm/sync_s": self.sync_s, "vllm/syncs": float(self.syncs)}
        for i, count in enumerate(self.requests):
            out[f"vllm/requests_{i}"] = float(count)
        self.sync_s, self.syncs, self.requests = 0.0, 0, [0] * len(self.requests)
        return out

    def close(self) -> None:
        """Stop the servers jaxrl started, drop the written weights; safe to call again."""
        if self.transfer is not None:
            self.transfer.close()
        for server in self.servers:
            server.stop()
        self._pool.shutdown(wait=False, cancel_futures=True)
        with contextlib.suppress(OSError):
            shutil.rmtree(self._dir, ignore_errors=True)
