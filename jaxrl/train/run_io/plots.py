"""Training curves as a PNG (matplotlib's object API and Agg canvas: no display needed)."""

from __future__ import annotations

import io
import os
from collections.abc import Mapping, Sequence
from typing import Any

from etils import epath

from jaxrl.runtime import storage

# held-out metrics drawn on the accuracy panel, with their legend labels
EVAL_CURVES = {
    "eval/accuracy_sampled": "sampled at the training temperature (eval/accuracy_sampled)",
    "eval/accuracy": "greedy (eval/accuracy)",
}


def plot_reward_and_accuracy(
    rows: Sequence[dict[str, Any]],
    path: str | os.PathLike,
    *,
    start: Mapping[str, float] | None = None,
    title: str = "GRPO",
) -> epath.Path:
    """Mean reward per optimizer step, and held-out accuracies at eval steps, side by side.

    ``start`` (held-out metrics before the first step, keyed like the rows) is drawn at step 0.
    The accuracy panel shows every metric of ``EVAL_CURVES`` the rows carry.
    """
    from matplotlib.figure import Figure  # no pyplot: the caller's backend stays untouched

    steps = [r["step"] for r in rows if r.get("reward") is not None]
    rewards = [r["reward"] for r in rows if r.get("reward") is not None]
    fig = Figure(figsize=(10, 3.6))
    ax_r, ax_a = fig.subplots(1, 2)
    ax_r.plot(steps, rewards, lw=1.2)
    ax_r.set(xlabel="optimizer step", ylabel="mean reward", title=f"{title}: reward")
    for key, label in EVAL_CURVES.items():
        points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        if start and start.get(key) is not None:
            points = [(0, start[key]), *points]
        if points:
            ax_a.plot(*zip(*points, strict=True), marker="o", ms=3, label=label)
    ax_a.set(xlabel="optimizer step", ylabel="held-out accuracy", title=f"{title}: held-out")
    ax_a.set_ylim(0, 1)
    if ax_a.lines:
        ax_a.legend(loc="lower right", fontsize=8)
    for ax in (ax_r, ax_a):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100)  # the Agg canvas for PNG: no display needed
    storage.write_bytes(path, png.getvalue())  # a local path or a URL, atomically
    return storage.path(path)
