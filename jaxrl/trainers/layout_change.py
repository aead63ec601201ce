"""What a resume onto changed settings means, from the previous run's ``config.json``: one line
comparing its ``mesh`` and ``schedule`` settings with this run's, and the refusal of a resume
onto another model (named before any checkpoint is read)."""

from __future__ import annotations

from typing import Any

from jaxrl.config.run import STAGE_SECTIONS

__all__ = ["layout_change_line", "model_change_error", "model_changes"]

SECTIONS = ("mesh", "schedule")
STEP_SIZE = "schedule.docs_per_step"  # not layout: it sets the documents of a step


def _flat(d: Any, prefix: str) -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    return {k: v for key, sub in d.items() for k, v in _flat(sub, f"{prefix}.{key}").items()}


# model settings that decide the shapes of the checkpointed parameters (model.scan_layers, the
# layer layout, is checked against the checkpoint itself: Session._check_layer_layout)
SHAPE_KEYS = ("model.init.", "model.lora.rank", "model.lora.target_modules")


def model_changes(
    previous: dict[str, Any] | None, current: dict[str, Any], *, shapes_only: bool = False
) -> str:
    """``model.x: old -> new`` for every ``model`` setting (``model.init`` included) in which
    the previous run of an output directory differs from this one (``shapes_only``: those of
    ``SHAPE_KEYS``); empty when none does."""
    if not previous or not isinstance(previous.get("model"), dict):
        return ""
    old, new = _flat(previous["model"], "model"), _flat(current["model"], "model")
    keys = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    if shapes_only:
        keys = [k for k in keys if k.startswith(SHAPE_KEYS)]
    return ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys)


def model_change_error(
    previous: dict[str, Any] | None, current: dict[str, Any], output_dir: str
) -> str:
    """The one-line refusal of a resume onto a model whose parameter shapes differ from the
    checkpoints' (the previous run's ``config.json`` says so; no checkpoint is read), or
    empty when the model settings that decide the shapes are unchanged."""
    changed = model_changes(previous, current, shapes_only=True)
    if not changed:
        return ""
    return (
        f"output_dir={output_dir!r} holds checkpoints of another model ({changed}; from its "
        "config.json): resume with the previous model settings, or start fresh with "
        "checkpoint.resume=false, another output_dir, or after deleting the directory"
    )


def layout_change_line(
    previous: dict[str, Any] | None, current: dict[str, Any], *, step: int, ranks: int
) -> str:
    """One line naming every ``mesh.*`` / ``schedule.*`` setting that differs between the
    previous run of an output directory and this one, and what resuming at ``step`` then means;
    empty when none differs (or there is no previous config). ``ranks``: this run's
    data-parallel ranks (mesh.data × mesh.fsdp)."""
    if not previous:
        return ""
    old: dict[str, Any] = {}
    new: dict[str, Any] = {}
    for section in SECTIONS:
        old.update(_flat(previous.get(section, {}), section))
        new.update(_flat(current.get(section, {}), section))
    keys = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    if not keys:
        return ""
    changes = ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys)
    layout = [k for k in keys if k != STEP_SIZE]
    notes = [
        f"resuming at step {step} with other mesh/schedule settings than the previous run in "
        f"this output_dir: {changes}."
    ]
    if layout:
        names = layout[0] if len(layout) == 1 else f"{', '.join(layout[:-1])} and {layout[-1]}"
        verb = "decides" if len(layout) == 1 else "decide"
        notes.append(
            f"{names} only {verb} how each step's documents are packed into "
            "micro-batches and spread over devices; every loss is a ratio of sums over the whole "
            "step, so the resumed steps make the updates the previous layout would have made (up "
            "to floating-point rounding)."
        )
    section = STAGE_SECTIONS.get(current.get("algorithm"))  # every section's batch is per rank
    if section is not None and any(k in ("mesh.data", "mesh.fsdp") for k in keys):
        notes.append(
            f"But {section}.per_device_train_batch_size counts per data-parallel rank: if the "
            f"rank count (mesh.data × mesh.fsdp, now {ranks}) changed, so did the documents per "
            "step."
        )
    if STEP_SIZE in keys:
        notes.append(
            f"{STEP_SIZE} sets the documents per step: from here on the steps differ from the "
            "previous run's."
        )
    return " ".join(notes)
