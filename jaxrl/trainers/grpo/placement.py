"""Where generation reads the trainer's weights: a copy on the generation devices, or the
trainer's own arrays."""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh

from jaxrl.runtime.mesh import replicated

__all__ = ["generation_params", "snapshot"]


def snapshot(session: Any, mesh: Mesh) -> Any:
    """A copy of the current parameters where generation runs (``mesh``), which later train
    steps (they donate their buffers) leave alone: the asynchronous generations' weights."""
    params = session.policy_params
    if mesh is not session.mesh:
        return jax.device_put(params, replicated(mesh), may_alias=False)
    return jax.tree.map(lambda x: jax.device_put(x, x.sharding, may_alias=False), params)


def generation_params(session: Any, mesh: Mesh) -> Any:
    """The current parameters where the generator's scorer runs (``mesh``): themselves, or a
    copy on the generation devices."""
    if mesh is session.mesh:
        return session.policy_params
    return snapshot(session, mesh)
