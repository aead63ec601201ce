"""``model.path`` as a Hugging Face hub id (``org/name``), as ``data.train`` takes hub names:
resolved with ``huggingface_hub.snapshot_download`` through the hub cache. No network here: the
cache is built in tmp_path and the hub is offline (``HF_HUB_OFFLINE``), as on a machine whose
models were downloaded before."""

from __future__ import annotations

import json

import huggingface_hub.constants as hub_constants
import pytest

from jaxrl.config import ConfigError, load_run_config
from jaxrl.data.hub import is_hub_id, local_model_dir
from jaxrl.trainers.preamble import Preamble, with_local_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"
QWEN2_TINY = {  # config.json of a tiny Qwen2 (what the hub's snapshot holds)
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
}


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """A hub cache holding ``tiny-org/tiny-qwen`` at ``main``, the hub offline."""
    cache = tmp_path / "hub"
    repo = cache / "models--tiny-org--tiny-qwen"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(QWEN2_TINY))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    return snapshot


def test_a_hub_id_resolves_to_its_cached_snapshot(offline_hub, tmp_path):
    assert local_model_dir("tiny-org/tiny-qwen") == str(offline_hub)
    assert local_model_dir(f"tiny-org/tiny-qwen@{COMMIT}") == str(offline_hub)
    local = tmp_path / "local"
    local.mkdir()
    assert local_model_dir(str(local)) == str(local)  # a local path is never looked up
    assert not is_hub_id(str(local)) and not is_hub_id("./models/x") and not is_hub_id("/a/b")
    assert is_hub_id("Qwen/Qwen2.5-0.5B-Instruct") and not is_hub_id("a/b/c")


def test_a_run_reads_the_snapshot(offline_hub, tmp_path):
    """The config holds the id as given (it touches no network); the run's preamble reads the
    snapshot, whose config.json shapes the model."""
    sets = [f"output_dir={tmp_path / 'run'}", "model.path=tiny-org/tiny-qwen", "model.init={}"]
    cfg = load_run_config("configs/sft_tiny.yaml", sets)
    assert cfg.model.path == "tiny-org/tiny-qwen"
    assert with_local_model(cfg).model.path == str(offline_hub)
    assert Preamble(cfg).cfg.model.path == str(offline_hub)
    assert with_local_model(load_run_config("configs/sft_tiny.yaml")) is not None


@pytest.mark.parametrize("path", ["no-org/no-model", "models/Qwen2.5-0.5B-Instruct"])
def test_an_id_the_hub_cannot_provide_is_one_config_error(offline_hub, path):
    with pytest.raises(ConfigError) as err:
        local_model_dir(path)
    message = str(err.value)
    assert message.startswith(f"model.path={path!r} is not a local directory, and the Hugging")
    assert "HF_HUB_OFFLINE=1" in message and "\n" not in message


def test_a_snapshot_without_config_json_is_not_a_model(offline_hub):
    (offline_hub / "config.json").unlink()
    (offline_hub / "README.md").write_text("a dataset")
    with pytest.raises(ConfigError, match=r"has no config.json, so it is not a transformers"):
        local_model_dir("tiny-org/tiny-qwen")
