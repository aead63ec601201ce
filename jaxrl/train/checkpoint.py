"""Orbax checkpoints: train state + host-side data cursor, newest N kept, atomic.

Orbax writes each step into a temporary directory and renames it on commit, so a crash
mid-save leaves the previous checkpoint as the newest usable one; unfinished temporaries are
never listed as steps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp


class Checkpointer:
    """Save/restore ``(TrainState, host JSON)`` pairs under ``<output_dir>/checkpoints``."""

    def __init__(self, directory: str | Path, *, keep: int = 2):
        self.directory = Path(directory).absolute()
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

    def restore(self, template: Any, step: int | None = None) -> tuple[Any, dict[str, Any]]:
        """Restore onto ``template``'s structure, shapes, dtypes and shardings."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
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
