"""What a benchmark ran on: CPU model, core count, Python, package versions, load."""

from __future__ import annotations

import os
import platform
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any


def machine(packages: tuple[str, ...]) -> dict[str, Any]:
    """The machine and the versions of ``packages`` (None where not installed)."""
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor() or "unknown",
    )
    versions: dict[str, str | None] = {}
    for pkg in packages:
        try:
            versions[pkg] = version(pkg)
        except PackageNotFoundError:  # reported as missing
            versions[pkg] = None
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "cpu": cpu,
        "python": platform.python_version(),
        "versions": versions,
        "load_average": os.getloadavg(),
    }
