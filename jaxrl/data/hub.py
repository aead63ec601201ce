"""``model.path`` as a Hugging Face hub id: ``org/name`` (or ``name``, with ``@revision``) that is
not a local path is downloaded into the hub cache with ``huggingface_hub.snapshot_download`` and
read from there, as ``data.train`` reads a hub dataset name (docs/data.md). The hub's own
settings apply: ``HF_HOME`` / ``HF_HUB_CACHE`` (where), ``HF_HUB_OFFLINE=1`` (the cache only),
``HF_TOKEN`` (gated models)."""

from __future__ import annotations

import re
from pathlib import Path

from jaxrl.runtime.errors import ConfigError

__all__ = ["HUB_FILES", "is_hub_id", "local_model_dir"]

# what a model directory needs: config.json, the weights, the tokenizer and its chat template
HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]
# a repo id: name or org/name of letters, digits, "-", "_", "."; optionally @revision
_REPO_ID = re.compile(r"^(?:[\w.-]+/)?[\w.-]+(?:@[\w./-]+)?$")


def is_hub_id(path: str) -> bool:
    """``path`` names a hub repository, not a local path: ``org/name`` or ``name`` (not
    ``.``-led, no ``..``, no absolute path or ``~``) that does not exist on disk."""
    if Path(path).expanduser().exists() or path.startswith((".", "/", "~")) or ".." in path:
        return False
    return bool(_REPO_ID.match(path))


def local_model_dir(path: str, field: str = "model.path") -> str:
    """The local directory of ``path``: itself when it is a local path, else (a hub id) the
    snapshot ``huggingface_hub.snapshot_download`` fetches or finds in the cache. A hub id the
    hub cannot provide is a ``ConfigError`` naming ``field`` and the reason."""
    if not is_hub_id(path):
        return path
    repo_id, _, revision = path.partition("@")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover - a dependency of datasets and of jaxrl
        raise ConfigError(
            f"{field}={path!r} is not a local directory; to read it from the Hugging Face hub "
            "install huggingface_hub (pip install huggingface_hub)"
        ) from None
    try:
        local = snapshot_download(repo_id, revision=revision or None, allow_patterns=HUB_FILES)
    except Exception as e:  # noqa: BLE001 - every failure of the hub means the same to the user
        reason = " ".join(str(e).split())[:300] or type(e).__name__
        raise ConfigError(
            f"{field}={path!r} is not a local directory, and the Hugging Face hub could not "
            f"provide it ({type(e).__name__}: {reason}); give a local HF directory "
            "(config.json + *.safetensors + tokenizer.json) or a hub id such as "
            "Qwen/Qwen2.5-0.5B-Instruct, downloaded into HF_HOME (with HF_HUB_OFFLINE=1 it must "
            "be in the cache already: huggingface-cli download <id>)"
        ) from None
    if not (Path(local) / "config.json").is_file():
        raise ConfigError(
            f"{field}={path!r}: the hub snapshot {local} has no config.json, so it is not a "
            "transformers model; give a model repository or a local HF directory"
        )
    return str(local)
