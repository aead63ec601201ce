"""Orbax checkpoints: round trip, keep-last-N, unfinished saves never restored; bf16 moments."""

from __future__ import annotations

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.config.sections.optimizer import OptimizerConfig
from jaxrl.models.model_config import ModelConfig
from jaxrl.models.transformer import Transformer
from jaxrl.train.optimizer import make_optimizer
from jaxrl.train.run_io.checkpoint import Checkpointer
from jaxrl.train.state import TrainState


def _state(param_dtype="float32"):
    cfg = ModelConfig.tiny(
        32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, param_dtype=param_dtype
    )
    _, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    return TrainState.create(params, make_optimizer(OptimizerConfig(), 10), seed=3)


def test_round_trip_keep_last_and_unfinished_saves_are_ignored(tmp_path):
    ckpt = Checkpointer(tmp_path / "ckpt", keep=2)
    state = _state()
    for step in (1, 2, 3):
        s = state.replace(step=jnp.int32(step), documents_seen=jnp.int32(10 * step))
        ckpt.save(step, s, {"feed": {"epoch": step}})
    assert sorted(int(p.name) for p in (tmp_path / "ckpt").iterdir() if p.name.isdigit()) == [2, 3]
    # A crash mid-save leaves a temporary directory; it must never be taken as a checkpoint.
    (tmp_path / "ckpt" / "4.orbax-checkpoint-tmp-1234").mkdir()
    assert Checkpointer(tmp_path / "ckpt", keep=2).latest_step() == 3
    restored, host = ckpt.restore(state)
    assert int(restored.step) == 3 and int(restored.documents_seen) == 30
    assert host == {"feed": {"epoch": 3}}
    for a, b in zip(jax.tree.leaves(restored.params), jax.tree.leaves(state.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(restored.rng), np.asarray(state.rng))
    ckpt.close()


def test_bf16_params_get_fp32_optimizer_moments():
    state = _state("bfloat16")
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.bfloat16)}
    moments = [x for x in jax.tree.leaves(state.opt_state) if jnp.ndim(x) > 0]
    assert moments and {x.dtype for x in moments} == {jnp.dtype(jnp.float32)}
