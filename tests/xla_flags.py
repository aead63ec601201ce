"""The XLA flags every test process compiles with: the suite's own (tests/conftest.py) and the
subprocesses that start without the suite's ``XLA_FLAGS`` (the CLI sizes its own host devices)
but whose numbers a test compares with the suite's."""

import os

# XLA:CPU's LLVM at -O1, not -O2 (tests/conftest.py); not -O0: that changes the sampler's bf16
# matmuls (tests/test_decode_model.py's bf16-operand test fails by 1e-3)
COMPILE_FLAGS = "--xla_backend_optimization_level=1"


def subprocess_env(**extra: str) -> dict[str, str]:
    """This process's environment with ``XLA_FLAGS`` reduced to :data:`COMPILE_FLAGS` (no host
    device count: the child sizes its own), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return {**env, "XLA_FLAGS": COMPILE_FLAGS, **extra}
