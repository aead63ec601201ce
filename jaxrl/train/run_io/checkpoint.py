"""Orbax checkpoints: train state + host-side data cursor, newest N kept, atomic, checksummed.

Orbax writes each step into a temporary directory and renames it on commit, so a crash
mid-save leaves the previous checkpoint as the newest usable one; unfinished temporaries are
never listed as steps. Orbax keeps no checksums, so after the commit process 0 writes
``<step>/jaxrl_checksums.json`` (SHA-256 and size of every file of the step, written to a
temporary name and renamed); ``restore`` verifies it first, so flipped or truncated bytes are
caught before any value is read. A step committed without the file (a crash between the commit
and the checksums, or an older jaxrl) is restored unverified; the finiteness check still runs.

The directory may be a storage URL (``gs://bucket/run/checkpoints``: ``jaxrl.runtime.storage``);
there orbax commits a step by writing its ``commit_success.txt`` last instead of renaming, and
a step without it is likewise never listed.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from etils import epath

from jaxrl.runtime import storage


class Checkpointer:
    """Save/restore ``(TrainState, host JSON)`` pairs under ``<output_dir>/checkpoints``."""

    def __init__(self, directory: str | os.PathLike, *, keep: int = 2):
        self.directory = storage.absolute(directory)  # a local path or a URL (gs://...)
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
            # named handlers let item_metadata read a checkpoint this process did not write
            item_handlers={
                "state": ocp.StandardCheckpointHandler(),
                "host": ocp.JsonCheckpointHandler(),
            },
        )

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def steps(self) -> list[int]:
        """Committed checkpoint steps, newest first."""
        return sorted(self._manager.all_steps(), reverse=True)

    def save(self, step: int, state: Any, host: dict[str, Any]) -> None:
        """Save and wait until the checkpoint is committed."""
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), host=ocp.args.JsonSave(host)
            ),
        )
        self._manager.wait_until_finished()
        if jax.process_index() == 0:
            write_checksums(self.directory / str(step))

    def restore(self, template: Any, step: int | None = None) -> tuple[Any, dict[str, Any]]:
        """Restore onto ``template``'s structure, shapes, dtypes and shardings."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        verify_checksums(self.directory / str(step))
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), host=ocp.args.JsonRestore()
            ),
        )
        return restored.state, dict(restored.host)

    def stacked_layers(self, step: int) -> bool | None:
        """Whether checkpoint ``step`` holds a scanned layer stack (``params.layers.attn...``,
        ``model.scan_layers``) rather than one entry per layer (``params.layers.0...``); None
        when its metadata cannot be read (the restore then reports the damage)."""
        try:
            layers = self._manager.item_metadata(step)["state"]["params"]["layers"]
            return not any(str(key).isdigit() for key in layers.keys())  # noqa: SIM118
        except Exception:  # missing or damaged metadata: orbax raises many kinds
            return None

    def close(self) -> None:
        self._manager.close()


CHECKSUMS = "jaxrl_checksums.json"


class ChecksumError(ValueError):
    """A checkpoint's files differ from the checksums written when it was saved."""


def _digests(step_dir: epath.Path) -> dict[str, list]:
    out = {}
    for name, f in storage.files(step_dir):
        if f.name != CHECKSUMS and not f.name.startswith(f".{CHECKSUMS}"):
            digest, size = hashlib.sha256(), 0
            with f.open("rb") as fh:  # streamed: a step's files may be larger than memory
                while chunk := fh.read(1 << 22):
                    digest.update(chunk)
                    size += len(chunk)
            out[name] = [digest.hexdigest(), size]
    return out


def write_checksums(step_dir: epath.Path) -> None:
    """Record SHA-256 and size of every file of a committed step (atomically: temp + rename
    locally, one upload on an object store)."""
    storage.write_text(step_dir / CHECKSUMS, json.dumps(_digests(step_dir), indent=0))


def verify_checksums(step_dir: epath.Path) -> None:
    """Raise ``ChecksumError`` naming the first file whose bytes or size changed, or that is
    missing; a step without a checksum file passes (see the module docstring)."""
    path = step_dir / CHECKSUMS
    if not path.is_file():
        return
    try:
        expected = json.loads(path.read_text())
    except ValueError:
        raise ChecksumError(f"{path} is damaged (not JSON)") from None
    actual = _digests(step_dir)
    for name, (digest, size) in expected.items():
        if name not in actual:
            raise ChecksumError(f"{step_dir / name} is missing")
        got_digest, got_size = actual[name]
        if got_size != size:
            raise ChecksumError(f"{step_dir / name} has {got_size} bytes, {size} were written")
        if got_digest != digest:
            raise ChecksumError(f"{step_dir / name} changed since it was written (SHA-256)")


def nonfinite_leaves(tree: Any) -> list[str]:
    """Paths of floating-point leaves of ``tree`` that hold a NaN or ±inf (sharded arrays are
    checked where they lie; one boolean per leaf comes back)."""
    bad = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if jnp.issubdtype(leaf.dtype, jnp.floating) and not bool(_all_finite(leaf)):
            bad.append(jax.tree_util.keystr(path))
    return bad


@jax.jit
def _all_finite(x: jax.Array) -> jax.Array:
    return jnp.all(jnp.isfinite(x))
