"""Test-wide settings: 8 XLA host devices and strict numerics, set before jax initialises."""

import os
import tempfile

import pytest

# The 8 host devices' collectives meet in one process. On a 2-core machine running two pytest
# workers a device's thread can reach a collective long after the others (seen: minutes, in the
# ZeRO-3 MoE step); XLA's default then aborts the whole worker ("Fatal Python error: Aborted",
# no message) instead of waiting, so the tests wait up to 20 minutes. A worker still died once
# since (CI, the expert-parallel MoE step, cold cache; not reproduced here loaded or cold): such a
# test is run once more on a fresh worker (pytest-rerunfailures, pyproject.toml's addopts).
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8"
    + " --xla_cpu_collective_call_terminate_timeout_seconds=1200"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Every trainer compiles its step, sampler and scorer, and the programs repeat across tests: the
# persistent compilation cache (keyed by the HLO) lives in the temp directory, not ~/.cache
# (compile_cache: true's default); tests/test_compile_cache.py gives its runs their own.
os.environ.setdefault(
    "JAXRL_COMPILE_CACHE", os.path.join(tempfile.gettempdir(), "jaxrl-test-jax-cache")
)

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_default_matmul_precision", "highest")

from jaxrl.runtime import compile_cache  # noqa: E402
from jaxrl.runtime.compile_cache import enable_compile_cache  # noqa: E402

# Every program is written to the cache, however fast it compiled (the library skips those under
# compile_cache.MIN_COMPILE_SECONDS): the same tiny programs recur across tests and across the
# two workers, which share the cache directory.
compile_cache.MIN_COMPILE_SECONDS = 0.0
enable_compile_cache(True)


@pytest.fixture(autouse=True, scope="session")
def _device_pool():
    """Each test's meshes take the first devices they need from the 8 host devices (a config
    with mesh.data=1 runs on one device, mesh.data=8 on all), as ``use_devices(subset=True)``
    documents. Tests of the strict rule open their own ``use_devices(...)``."""
    from jaxrl.runtime.mesh import use_devices

    with use_devices(jax.devices(), subset=True):
        yield


def pytest_collection_modifyitems(items):
    """The files that hold a slow test run first, each file's tests together and in their order:
    with ``-n 2`` the suite ends when its last test does, so what is left for the last minutes
    are short tests that the two workers share (``--dist worksteal``, pyproject.toml), not one
    worker's minute-long layout test with the other idle. Every worker collects the same order."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    order = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda item: (item.path not in slow_files, order[id(item)]))


# JAXRL_TEST_COMPILE_LOG=<dir>: each worker writes, per test, the seconds XLA spent compiling
# (backend compiles only: a persistent-cache hit costs none) and how many programs it compiled,
# to <dir>/<worker>.jsonl. Where a cold suite's time goes: docs/results.md ("The test suite").
_COMPILE_LOG = os.environ.get("JAXRL_TEST_COMPILE_LOG")
if _COMPILE_LOG:
    import json
    import time

    _compiles: dict[str, list[float]] = {}
    _current = ["<collection>"]

    def _on_duration(event: str, duration: float, **_: object) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            _compiles.setdefault(_current[0], []).append(duration)

    jax.monitoring.register_event_duration_secs_listener(_on_duration)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(item, call):
        report = yield
        setattr(item, f"_report_{report.when}", report)
        return report

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        _current[0] = item.nodeid
        start = time.perf_counter()
        try:
            return (yield)
        finally:
            times = _compiles.pop(item.nodeid, [])
            reports = [getattr(item, f"_report_{when}", None) for when in ("setup", "call")]
            failed = any(r is not None and r.failed for r in reports)
            record = {"test": item.nodeid, "wall": time.perf_counter() - start, "failed": failed}
            record |= {"compile_s": sum(times), "programs": len(times)}
            worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
            os.makedirs(_COMPILE_LOG, exist_ok=True)
            with open(os.path.join(_COMPILE_LOG, f"{worker}.jsonl"), "a") as f:
                f.write(json.dumps(record) + "\n")
