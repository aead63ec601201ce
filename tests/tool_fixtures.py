"""Tool functions for the subprocess-isolation test: standard library only, so the worker
process loads them within a small memory limit (a test module would import torch)."""

import os
import time


def sleepy(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "awake"


def hog(megabytes: int) -> int:
    """Allocate memory.

    Args:
        megabytes: how much
    """
    return len(bytearray(megabytes * 2**20))


def die(code: int) -> int:
    """Exit the process.

    Args:
        code: exit code
    """
    os._exit(code)


def boom(x: int) -> int:
    """Always fails.

    Args:
        x: ignored
    """
    raise KeyError("no such key")
