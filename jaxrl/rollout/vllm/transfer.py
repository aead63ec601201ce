"""GPU weight sync for ``rollout.backend: vllm``: vLLM's own NCCL and CUDA-IPC weight-transfer
engines, fed with JAX buffers handed over by DLPack (``rollout.vllm.weight_transfer``).

The tensors are those of the disk path (``weights.export_weights``): the HF names, layout and
dtype of jaxrl's exporter (``jaxrl.models.hf.hf_arrays``), the output head untied
(``weights.untied``). Each is a JAX array on one device, handed to torch with
``torch.from_dlpack`` (no copy), and vLLM's trainer-side engine
(``vllm.distributed.weight_transfer``, ``WeightTransferTrainerFactory.trainer_init``) sends it:

- **nccl**: a NCCL group of the trainer (rank 0) and every worker of the server, set up once per
  server (``/init_weight_transfer_engine`` with a TCP rendezvous on the trainer's host), then
  per sync ``/start_weight_update`` → ``/update_weights`` (names, dtypes, shapes) running while
  the trainer broadcasts the tensors (packed into buffers) → ``/finish_weight_update``.
- **ipc**: the server on the same GPU as the trainer; per sync the tensors are copied (on the
  GPU) into IPC buffers in chunks, and each ``/update_weights`` carries a chunk's CUDA IPC
  handle (pickled: the server needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``), which the
  server's worker reads directly.

Either runs inside the same pause / version / prefix-cache steps as the disk path
(``ServerClient.update_weights``). Both need CUDA on both sides (torch with CUDA and vLLM in the
trainer's environment, JAX on the GPU): asked for without, the backend raises a ConfigError
naming ``rollout.vllm.weight_transfer``. docs/rollout.md, "GPU weight transfer".
"""

from __future__ import annotations

import base64
import pickle
import socket
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlparse

import jax

from jaxrl.config.base import config_error
from jaxrl.models.hf import hf_shapes
from jaxrl.rollout.vllm.client import ServerClient, VLLMError
from jaxrl.rollout.vllm.server import free_port
from jaxrl.rollout.vllm.weights import hf_tensors, untied

__all__ = [
    "JaxWeights",
    "SyncClient",
    "WeightTransfer",
    "check_cuda",
    "dlpack_tensors",
]

FIELD = "rollout.vllm.weight_transfer"


def dlpack_tensors(
    graphdef: Any, params: Any, *, dtype: str, device: jax.Device | None = None
) -> Iterator[tuple[str, Any]]:
    """``hf_tensors`` handed to torch by DLPack, one at a time: each array is first put whole
    on ``device`` (default: the first local device; DLPack takes one device's buffer), then
    ``torch.from_dlpack`` views it without a copy."""
    import torch

    device = device or jax.local_devices()[0]
    for name, array in hf_tensors(graphdef, params, dtype=dtype):
        if array.sharding.device_set != {device}:
            array = jax.device_put(array, device)
        yield name, torch.from_dlpack(array.block_until_ready())  # computed before it is read


def check_cuda(kind: str) -> None:
    """A ConfigError unless ``kind`` (``rollout.vllm.weight_transfer``) can run here: disk
    always; nccl and ipc need torch with CUDA, vLLM importable and JAX on a GPU."""
    if kind == "disk":
        return
    try:
        import torch
    except ImportError:
        torch = None
    reasons = []
    if torch is None:
        reasons.append("torch is not installed")
    elif not torch.cuda.is_available():
        reasons.append(f"torch {torch.__version__} sees no CUDA device")
    if jax.default_backend() != "gpu":
        reasons.append(f"JAX runs on {jax.default_backend()}, not a GPU")
    if not reasons:  # (a CPU vLLM build may not even import beside the trainer)
        try:
            import vllm.distributed.weight_transfer  # noqa: F401
        except Exception as e:  # noqa: BLE001 - any failure to import is the answer
            reasons.append(f"vLLM's weight transfer cannot be imported ({type(e).__name__})")
    if reasons:
        raise config_error(
            FIELD,
            kind,
            f"{kind} sends the weights GPU to GPU and needs CUDA: {'; '.join(reasons)}. Use "
            "rollout.vllm.weight_transfer=disk (works everywhere), or run on a GPU with "
            "jax[cuda12] and vLLM's CUDA build installed",
        )


class SyncClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol (the four weight-update routes) over jaxrl's
    :class:`ServerClient`: every call has ``rollout.vllm.timeout``, every failure is one line
    naming the URL (vLLM's own HTTP client raises ``requests``' errors instead)."""

    def __init__(self, client: ServerClient):
        self.client = client

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._post("/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self._post("/start_weight_update", None)

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        infos = update_info if isinstance(update_info, list) else [update_info]
        safe = [_json_safe(info) for info in infos]
        self._post("/update_weights", {"update_info": safe if isinstance(update_info, list)
                                       else safe[0]})  # fmt: skip

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        body = None if weight_version is None else {"weight_version": weight_version}
        self._post("/finish_weight_update", body)

    def shutdown_weight_transfer_engine(self) -> None:
        self._post("/shutdown_weight_transfer_engine", None)

    def world_size(self) -> int:
        """The server's workers (tensor × pipeline × data parallel)."""
        answer = self.client.call("GET", "/get_world_size", fix=_FIX)
        size = answer.get("world_size") if isinstance(answer, dict) else None
        if not isinstance(size, int) or size < 1:
            raise VLLMError(
                f"vLLM server {self.client.url}: GET /get_world_size answered {answer!r}; {_FIX}"
            )
        return size

    def _post(self, path: str, body: dict[str, Any] | None) -> None:
        self.client.call("POST", path, body, fix=_FIX)


_FIX = (
    "the server must be vLLM >= 0.32 started with VLLM_SERVER_DEV_MODE=1 and "
    '--weight-transfer-config \'{"backend": "<nccl|ipc>"}\' (ipc also '
    "VLLM_ALLOW_INSECURE_SERIALIZATION=1, on the trainer's GPU); see its log"
)


def _json_safe(info: dict[str, Any]) -> dict[str, Any]:
    """CUDA IPC handles are not JSON: pickled and base64-encoded into ``ipc_handles_pickled``
    (as vLLM's own HTTP client sends them)."""
    if info.get("ipc_handles") is None:
        return info
    out = {k: v for k, v in info.items() if k != "ipc_handles"}
    out["ipc_handles_pickled"] = base64.b64encode(pickle.dumps(info["ipc_handles"])).decode()
    return out


class JaxWeights:
    """The weights one sync sends, for vLLM's trainer engine: ``metadata()`` (names, torch
    dtypes, shapes, without a transfer) and iteration (``dlpack_tensors``: one tensor made at
    a time). :meth:`set` points it at the next version's parameters. Wrapped as a vLLM
    ``WeightSource`` by :func:`as_weight_source` (vLLM is imported only there)."""

    def __init__(self, config: Any, graphdef: Any, *, dtype: str, device: jax.Device | None = None):
        self.config, self.graphdef, self.dtype, self.device = config, graphdef, dtype, device
        self.params: Any = None

    def set(self, params: Any) -> None:
        self.params = params

    def metadata(self) -> list[tuple[str, Any, tuple[int, ...]]]:
        """(name, torch dtype, shape) of every tensor, in the iteration's order."""
        import torch

        shapes = untied(hf_shapes(self.config).items(), self.config.tie_word_embeddings)
        dtype = getattr(torch, self.dtype)
        return [(name, dtype, shape) for name, shape in shapes]

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return dlpack_tensors(self.graphdef, self.params, dtype=self.dtype, device=self.device)


def as_weight_source(weights: JaxWeights) -> Any:
    """``weights`` as a ``vllm.distributed.weight_transfer.WeightSource``."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class _Source(WeightSource):
        def metadata(self) -> list[ParamMeta]:
            return [ParamMeta(n, d, s) for n, d, s in weights.metadata()]

        def __iter__(self) -> Iterator[tuple[str, Any]]:
            return iter(weights)

    return _Source()


EngineFactory = Callable[[str, SyncClient, JaxWeights], Any]


def vllm_trainer_engine(kind: str, client: SyncClient, weights: JaxWeights) -> Any:
    """vLLM's trainer-side engine for ``kind`` on one server, rendezvoused
    (``WeightTransferTrainerFactory.trainer_init``): nccl opens a TCP rendezvous on this host
    for the trainer and the server's workers; ipc only tells the server the wire format."""
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    source = as_weight_source(weights)
    if kind == "nccl":
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        info = NCCLTrainerInitInfo(
            master_address=_address_towards(client.client.url),
            master_port=free_port(),
            world_size=1 + client.world_size(),
            rank=0,
        )
    else:
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

        # packed: vLLM copies the tensors into IPC buffers torch allocated (GPU to GPU): CUDA
        # IPC cannot share XLA's allocations, which the DLPack views point at
        info = IPCTrainerInitInfo(rank=0, packed=True)
    return WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)


def _address_towards(url: str) -> str:
    """This host's address as the server at ``url`` reaches it (127.0.0.1 for a local one):
    the NCCL rendezvous's address."""
    host = urlparse(url).hostname or "127.0.0.1"
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # no packet is sent: only the route is chosen
        return s.getsockname()[0]


class WeightTransfer:
    """``rollout.vllm.weight_transfer`` nccl / ipc for a set of servers: one vLLM trainer
    engine per server, made at its first sync (``engine_factory``, default vLLM's), replayed
    for every later one."""

    def __init__(
        self,
        kind: str,
        config: Any,
        graphdef: Any,
        *,
        dtype: str,
        engine_factory: EngineFactory | None = None,
        device: jax.Device | None = None,
    ):
        self.kind = kind
        self.weights = JaxWeights(config, graphdef, dtype=dtype, device=device)
        self._factory = engine_factory or vllm_trainer_engine
        self._engines: dict[str, Any] = {}

    def send(self, client: ServerClient, params: Any) -> None:
        """Send ``params`` to the server of ``client`` (its update already begun: paused and
        tagged "updating"); its weights are the new ones when this returns."""
        self.weights.set(params)
        engine = self._engines.get(client.url)
        if engine is None:
            engine = self._factory(self.kind, SyncClient(client), self.weights)
            self._engines[client.url] = engine
        try:
            engine.send_weights()
        except VLLMError:
            raise
        except Exception as e:  # NCCL / CUDA errors from vLLM's engine: one line
            raise VLLMError(
                f"vLLM server {client.url}: {self.kind} weight transfer failed "
                f"({type(e).__name__}: {' '.join(str(e).split())[:200]}); check both sides' "
                "logs, or use rollout.vllm.weight_transfer=disk"
            ) from None
        finally:
            self.weights.set(None)

    def close(self) -> None:
        """Tear down every engine (NCCL groups) and tell the servers; safe to call again."""
        engines, self._engines = self._engines, {}
        for engine in engines.values():
            try:
                engine.shutdown()
                client = getattr(engine, "client", None)
                if isinstance(client, SyncClient):
                    client.shutdown_weight_transfer_engine()
            except Exception:  # noqa: BLE001 - closing: the servers may be gone already
                pass
