"""Training curves as a PNG (matplotlib's object API and Agg canvas: no display needed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def plot_reward_and_accuracy(
    rows: Sequence[dict[str, Any]],
    path: str | Path,
    *,
    start_accuracy: float | None = None,
    title: str = "GRPO",
) -> Path:
    """Mean reward per optimizer step and held-out accuracy at eval steps, side by side.

    ``start_accuracy`` (the accuracy before the first step) is drawn at step 0.
    """
    from matplotlib.figure import Figure  # no pyplot: the caller's backend stays untouched

    steps = [r["step"] for r in rows if r.get("reward") is not None]
    rewards = [r["reward"] for r in rows if r.get("reward") is not None]
    evals = [(r["step"], r["eval/accuracy"]) for r in rows if r.get("eval/accuracy") is not None]
    if start_accuracy is not None:
        evals = [(0, start_accuracy), *evals]
    fig = Figure(figsize=(10, 3.6))
    ax_r, ax_a = fig.subplots(1, 2)
    ax_r.plot(steps, rewards, lw=1.2)
    ax_r.set(xlabel="optimizer step", ylabel="mean reward", title=f"{title}: reward")
    if evals:
        ax_a.plot(*zip(*evals, strict=True), marker="o")
    ax_a.set(xlabel="optimizer step", ylabel="held-out accuracy", title=f"{title}: eval/accuracy")
    ax_a.set_ylim(0, 1)
    for ax in (ax_r, ax_a):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)  # Figure uses the Agg canvas for PNG: no display needed
    return out
