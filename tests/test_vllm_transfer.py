"""rollout.vllm.weight_transfer nccl / ipc (jaxrl/rollout/vllm/transfer.py) on CPU: what can run
without a GPU. The DLPack hand-over gives every tensor of the disk export (names, dtypes,
shapes, values); the HTTP protocol of a sync runs against the stub server (tests/vllm_stub.py)
with an engine that speaks vLLM's trainer-engine protocol, and, where vLLM is installed, vLLM's
own NCCL trainer engine (its broadcast replaced: no CUDA here); asked for without CUDA it is a
ConfigError. The GPU path itself has not run (docs/rollout.md, "GPU weight transfer")."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
import torch
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors.torch import load_file
from vllm_stub import StubVLLM

from jaxrl.config import ConfigError
from jaxrl.config.sections.vllm import VLLMConfig
from jaxrl.models.model_config import ModelConfig
from jaxrl.models.transformer import Transformer
from jaxrl.rollout.vllm import VLLMBackend, export_weights
from jaxrl.rollout.vllm import backend as backend_module
from jaxrl.rollout.vllm.transfer import JaxWeights, WeightTransfer, dlpack_tensors

VOCAB, EOS, PAD = 16, 1, 0
KEY = jax.random.key(0)


@pytest.fixture(scope="module")
def model():
    """A tied tiny model, its parameters replicated over every device (DLPack needs one
    device's buffer: the hand-over puts each array on one), and an untied variant."""
    cfg = ModelConfig.tiny(
        VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=64,
    )  # fmt: skip
    mesh = Mesh(np.array(jax.devices()), ("d",))
    out = {}
    for tied in (True, False):
        c = dataclasses.replace(cfg, tie_word_embeddings=tied)
        graphdef, state = nnx.split(Transformer(c, rngs=nnx.Rngs(int(tied))), nnx.Param)
        states = [jax.device_put(state, NamedSharding(mesh, P()))]
        states.append(jax.tree.map(lambda a: a * 1.5, states[0]))
        out[tied] = (c, graphdef, states)
    return out


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dlpack_tensors_are_the_disk_export(model, tmp_path, tied, dtype):
    """Every tensor handed over by DLPack is the disk exporter's: same names (the head untied),
    dtypes, shapes and values; metadata() declares them in the iteration's order."""
    cfg, graphdef, (params, _) = model[tied]
    path = export_weights(graphdef, params, tmp_path / "w", dtype=dtype, eos_ids=[EOS], pad_id=PAD)
    disk = load_file(str(path / "model.safetensors"))
    pairs = list(dlpack_tensors(graphdef, params, dtype=dtype))
    assert sorted(n for n, _ in pairs) == sorted(disk) and "lm_head.weight" in disk
    for name, tensor in pairs:
        assert tensor.dtype == disk[name].dtype == getattr(torch, dtype), name
        assert tuple(tensor.shape) == tuple(disk[name].shape), name
        assert torch.equal(tensor, disk[name]), name
    weights = JaxWeights(cfg, graphdef, dtype=dtype)
    weights.set(params)
    meta = [(n, t.dtype, tuple(t.shape)) for n, t in weights]
    assert weights.metadata() == meta


class FakeEngine:
    """vLLM's trainer-side engine protocol (vllm/distributed/weight_transfer: the NCCL engine's
    HTTP calls in its order; ipc: the handles in update_info), its data plane a record of the
    tensors it was given."""

    def __init__(self, kind, client, weights):
        self.kind, self.client, self.weights = kind, client, weights
        if kind == "nccl":
            client.init_weight_transfer_engine(
                {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                 "world_size": 1 + client.world_size(), "packed": True}
            )  # fmt: skip
        else:
            client.init_weight_transfer_engine({"packed": False})
        self.sent: list[list[str]] = []
        self.shut = False

    def send_weights(self):
        meta = self.weights.metadata()
        info = {"names": [m[0] for m in meta], "dtype_names": [str(m[1]).split(".")[-1]
                for m in meta], "shapes": [list(m[2]) for m in meta]}  # fmt: skip
        self.client.start_weight_update()
        pairs = list(self.weights)
        assert [(n, t.dtype, tuple(t.shape)) for n, t in pairs] == meta
        if self.kind == "ipc":
            info["ipc_handles"] = [{"GPU-uuid": (n, tuple(t.shape))} for n, t in pairs]
        self.client.update_weights(info)
        self.client.finish_weight_update()
        self.sent.append([n for n, _ in pairs])

    def shutdown(self):
        self.shut = True


def _backend(cfg, url, **kw) -> VLLMBackend:
    return VLLMBackend(
        cfg, VLLMConfig(url=url, timeout=5.0, verify=False, **kw), max_new_tokens=4,
        eos_id=EOS, pad_id=PAD, max_model_len=64,
    )  # fmt: skip


@pytest.mark.parametrize("kind", ["nccl", "ipc"])
def test_gpu_sync_protocol_against_the_stub(model, kind):
    """A sync through a weight-transfer engine: pause → "updating" → (once) the engine's init →
    start → update_weights (the export's names; IPC handles pickled over HTTP) → finish →
    prefix cache reset → the version → resume; the next sync re-uses the engine; generation
    reads the new version; close() shuts the engine down on the server."""
    cfg, graphdef, (p0, p1) = model[True]
    stub = StubVLLM(VOCAB)
    stub.world_size = 2
    be = _backend(cfg, stub.url)
    try:
        engines = []

        def factory(k, client, weights):
            engines.append(FakeEngine(k, client, weights))
            return engines[-1]

        be.transfer = WeightTransfer(kind, cfg, graphdef, dtype="float32", engine_factory=factory)
        be.load_params(p0, version=0)
        update = ["POST /start_weight_update", "POST /update_weights", "POST /finish_weight_update"]
        init = (["GET /get_world_size"] if kind == "nccl" else []) + [
            "POST /init_weight_transfer_engine"
        ]
        assert stub.calls == [
            "POST /pause", "POST /update_weight_version", *init, *update,
            "POST /reset_prefix_cache", "POST /update_weight_version", "POST /resume",
        ]  # fmt: skip
        assert stub.version == f"{be.run_id}:0" and len(engines) == 1
        names = sorted(stub.transfers[0]["names"])
        assert names == sorted(n for n, _ in dlpack_tensors(graphdef, p0, dtype="float32"))
        assert "lm_head.weight" in names  # the servers run the head untied
        if kind == "nccl":
            assert stub.transfer_init["world_size"] == 3
        else:
            assert stub.transfer_init == {"packed": False}
            handles = stub.transfers[0]["ipc_handles"]
            assert [h["GPU-uuid"][0] for h in handles] == stub.transfers[0]["names"]
        stub.calls.clear()
        be.load_params(p1, version=1)
        assert "POST /init_weight_transfer_engine" not in stub.calls and len(engines) == 1
        assert len(engines[0].sent) == 2 and stub.version == f"{be.run_id}:1"
        out = be.generate([[3, 4]], KEY)
        assert out.weight_version == 1 and out.tokens[0, 0] == (4 + 1 + 2) % VOCAB  # 2 updates
    finally:
        be.close()
        stub.stop()
    assert engines[0].shut and stub.transfer_init is None


def test_gpu_transfer_without_cuda_is_a_config_error(model):
    """nccl / ipc on a machine without CUDA (this one): a ConfigError naming the field, the
    value, why, and the fix (disk); an unknown kind is one too."""
    cfg = model[True][0]
    for kind in ("nccl", "ipc"):
        with pytest.raises(ConfigError) as e:
            _backend(cfg, "http://127.0.0.1:9", weight_transfer=kind)
        message = str(e.value)
        assert "rollout.vllm.weight_transfer" in message and kind in message, message
        assert "weight_transfer=disk" in message and "\n" not in message, message
    with pytest.raises(ConfigError, match="rollout.vllm.weight_transfer"):
        VLLMConfig(weight_transfer="rdma")


def test_a_started_server_gets_the_transfer_engine(model, monkeypatch, tmp_path):
    """The server jaxrl starts with nccl / ipc runs vLLM's weight-transfer engine of that kind
    (--weight-transfer-config), ipc with its pickled handles allowed."""
    cfg = model[True][0]
    monkeypatch.setattr(backend_module, "check_cuda", lambda kind: None)
    started = {}

    class Started(Exception):
        pass

    def fake_server(command, *, port, log_path, env):
        started.update(command=command, env=env)
        raise Started

    monkeypatch.setattr(backend_module, "LocalServer", fake_server)
    for kind in ("nccl", "ipc"):
        be = _backend(cfg, None, weight_transfer=kind)
        with pytest.raises(Started):
            be.load_params(model[True][2][0], version=0)
        be.close()
        i = started["command"].index("--weight-transfer-config")
        assert started["command"][i + 1] == f'{{"backend": "{kind}"}}'
        allowed = started["env"].get("VLLM_ALLOW_INSECURE_SERIALIZATION")
        assert allowed == ("1" if kind == "ipc" else None)


def test_vllms_own_nccl_trainer_engine_drives_the_stub(model, monkeypatch):
    """Where vLLM is installed: vLLM's NCCLTrainerWeightTransferEngine.send_weights runs over
    jaxrl's SyncClient and weight source against the stub (its NCCL broadcast replaced by a
    record: no CUDA here); vLLM's own checks of iteration vs metadata pass, and what it
    broadcasts is the disk export."""
    pytest.importorskip("vllm.distributed.weight_transfer.nccl_engine")
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine

    from jaxrl.rollout.vllm.client import ServerClient
    from jaxrl.rollout.vllm.transfer import SyncClient, as_weight_source

    cfg, graphdef, (params, _) = model[True]
    sent = []

    class Group:  # the PyNcclCommunicator's broadcast
        def broadcast(self, tensor, src, stream):
            sent.append(tensor.clone())

    monkeypatch.setattr(torch.cuda, "current_stream", lambda: None)
    stub = StubVLLM(VOCAB)
    try:
        weights = JaxWeights(cfg, graphdef, dtype="float32")
        weights.set(params)
        source = as_weight_source(weights)
        assert [len(g) for g in source.groups()] and sum(len(g) for g in source.groups()) == len(
            weights.metadata()
        )  # vLLM's per-layer groups cover every tensor
        stub.transfer_init = {}
        engine = NCCLTrainerWeightTransferEngine(
            client=SyncClient(ServerClient(stub.url, 5.0)), source=source, packed=False
        )
        engine.model_update_group = Group()
        engine.send_weights()
        info = stub.transfers[0]
        assert info["names"] == [m[0] for m in weights.metadata()]
        assert set(info["dtype_names"]) == {"float32"}
        want = dict(dlpack_tensors(graphdef, params, dtype="float32"))
        assert all(torch.equal(t, want[n]) for n, t in zip(info["names"], sent, strict=True))
    finally:
        stub.stop()
