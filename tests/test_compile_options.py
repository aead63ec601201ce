"""The compile options of the engine's programs: LLVM level 1 on the CPU backend."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.runtime import compile_options
from jaxrl.runtime.compile_options import program_options


def test_engine_programs_compile_at_llvm_level_1_on_cpu(monkeypatch):
    assert jax.default_backend() == "cpu"  # the suite runs on CPU host devices
    assert program_options() == {"xla_backend_optimization_level": 1}
    x = jnp.asarray(np.random.default_rng(0).standard_normal((64, 96)), jnp.float32)
    f = lambda x: jnp.tanh(x @ x.T).sum(axis=-1)  # noqa: E731
    # the level may move last bits (docs/performance.md), not results
    np.testing.assert_allclose(
        jax.jit(f, compiler_options=program_options())(x), jax.jit(f)(x), rtol=1e-6
    )
    program_options.cache_clear()
    monkeypatch.setenv(compile_options.ENV, "2")
    assert program_options() == {"xla_backend_optimization_level": 2}
    program_options.cache_clear()
    monkeypatch.setenv(compile_options.ENV, "fast")
    with pytest.raises(ValueError, match="JAXRL_CPU_OPT_LEVEL='fast'"):
        program_options()
    program_options.cache_clear()
