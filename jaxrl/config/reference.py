"""The config reference (docs/config_reference.md), generated from the config dataclasses.

Every section of ``RunConfig`` (``jaxrl.config.sections`` and the algorithm sections) becomes a
table of its fields: key, type, default and the field's
own one-line comment in the source (``name: type = default  # comment``, continuation comment
lines included), and the keys a section no longer has (``removed_fields``). The ``grpo`` and
``dpo`` sections are ``GRPOConfig`` and ``DPOConfig`` (less their ``RUN_FIELDS``, which the run
sets); ``model.init`` is the model shape, ``ModelConfig``. Because the page is built from the
classes, it cannot drift: ``tests/test_docs.py`` fails when the file in docs/ is stale.

    python -m jaxrl.config.reference --write   # regenerate docs/config_reference.md
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import io
import re
import sys
import textwrap
import tokenize
import types
import typing
from pathlib import Path
from typing import Any

DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "config_reference.md"

HEADER = """\
# Config reference

Every key `jaxrl train CONFIG.yaml` reads, section by section, with its type, default and
meaning. Set a key in the YAML file or on the command line with `--set section.key=value`.
Unknown or misspelled keys are errors that suggest the closest name; invalid values are errors
that name the field, the value and the fix.

This page is generated from the config dataclasses (`python -m jaxrl.config.reference --write`);
a test fails when it is stale, so it always matches the code.

## How a run is composed

A run has the run-level sections below (`mesh`, `schedule`, `optimizer`, `model`, `task` or
`data`, `checkpoint`, `logging`, `export`, `rollout`, `warm_start`) and the section of its own
`algorithm:`, and no other algorithm's: `sft`, `grpo`, `dpo`, `kto` or `ppo`. A section of
another algorithm (say `dpo:` with `algorithm: grpo`) is an error naming it. PPO's rollouts and
clipped actor objective are `ppo.actor`, a `grpo` section (the same keys); `ppo`'s own keys are
the critic's and GAE's. The `sft` section is SFT's, and the SFT warm start's of a GRPO, PPO, DPO
or KTO run that has a `warm_start` section.

One place per concept:

- **Learning rate.** `optimizer.learning_rate`, `optimizer.warmup_steps` and `optimizer.decay`
  are the schedule of the run's own stage (SFT, GRPO, PPO's actor, DPO, KTO). The SFT warm start
  has its own peak, warmup and decay in `warm_start.learning_rate`, `warm_start.warmup_steps`
  and `warm_start.decay` (each unset: `optimizer`'s); PPO's critic its own peak in
  `ppo.critic_learning_rate`. AdamW's other settings are `optimizer`'s for every stage.
- **Batch size.** Every section's batch counts per data-parallel rank, as TRL's
  `per_device_train_batch_size`: an optimizer step holds `per_device_train_batch_size ×
  gradient_accumulation_steps × ranks` examples, where ranks = `mesh.data × mesh.fsdp` (TRL's
  `per_device_train_batch_size × gradient_accumulation_steps × world size`). The examples are
  documents (SFT), completions (GRPO, PPO), pairs (DPO) or labelled examples (KTO).
  Unlike TRL, `gradient_accumulation_steps` does not cut the step into micro-batches:
  `schedule.max_tokens` does, and the update does not depend on how (README, "Why: exactness").
  With `schedule.docs_per_step > 0` the step holds that many documents instead.

| concept | jaxrl (every section) | TRL |
|---|---|---|
| examples per rank per micro-step (b) | `per_device_train_batch_size` | the same |
| micro-steps per optimizer step (g) | `gradient_accumulation_steps` | the same |
| ranks (P) | `mesh.data × mesh.fsdp` | world size |
| examples per step | b × g × P | b × g × world size |
| peak learning rate | `optimizer.learning_rate` | `learning_rate` |
| warm start's peak | `warm_start.learning_rate` | (a separate SFT run) |
| warmup, decay | `optimizer.warmup_steps`, `.decay` | `warmup_steps`, `lr_scheduler_type` |

The SFT warm start of `configs/grpo_tiny.yaml`:

```yaml
warm_start:
  steps: 500             # at most 500 SFT steps (the sft section) into output_dir/sft ...
  target: 0.5            # ... stopping at the first held-out check with greedy accuracy >= 0.5
  learning_rate: 1.5e-3  # its own peak and warmup; the decay is optimizer.decay
  warmup_steps: 50
optimizer:
  learning_rate: 3.0e-4  # the GRPO stage's
  warmup_steps: 10
  decay: cosine
```

Keys that moved are errors that name their new home (listed under each section below as
"Removed keys"): `sft_warmup_steps`, `sft_warmup_target`, `sft_warmup_eval_every` (now
`warm_start.steps`, `.target`, `.eval_every`); `grpo.learning_rate`, `grpo.warmup_steps`,
`grpo.lr_scheduler_type`, `dpo.learning_rate`, `kto.learning_rate` (now `optimizer.*`, or
`warm_start.*` for the warm start); `sft.batch_size` (global; now
`sft.per_device_train_batch_size` = batch_size / ranks); PPO's actor under `grpo.` (now
`ppo.actor.`).
"""


def field_comments(cls: type) -> dict[str, str]:
    """``{field: comment}`` from the class source: the trailing ``# ...`` of the line that
    declares the field, joined with the comment-only lines right after it."""
    source = textwrap.dedent(inspect.getsource(cls))
    names = {f.name for f in dataclasses.fields(cls)}
    comments: dict[str, str] = {}
    current: str | None = None
    depth = 0  # bracket depth: a field's default may span lines
    field_lines: set[int] = set()  # lines that declare a field
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.OP and tok.string in "([{":
            depth += 1
        elif tok.type == tokenize.OP and tok.string in ")]}":
            depth -= 1
        elif tok.type == tokenize.NAME and depth == 0 and tok.start[1] == 4 and tok.string in names:
            field_lines.add(tok.start[0])
            current = tok.string
        elif tok.type == tokenize.COMMENT and current is not None:
            text = tok.string.lstrip("#").strip()
            if tok.start[0] in field_lines or tok.line.strip().startswith("#"):
                comments[current] = f"{comments.get(current, '')} {text}".strip()
        elif tok.type == tokenize.NAME and tok.start[1] == 4 and tok.string == "def":
            break  # methods: no more fields
        elif tok.type == tokenize.NL and tok.line.strip() == "":
            current = None  # a blank line ends a field's continuation comments
    return comments


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return " \\| ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "None"
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(tp) if a is not Ellipsis)
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    return getattr(tp, "__name__", str(tp)).replace("typing.", "")


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        if dataclasses.is_dataclass(value):
            return "(section)"
    else:
        return "required"
    if isinstance(value, tuple):
        value = list(value)
    return f"`{value!r}`".replace("|", "\\|")


def _doc(cls: type) -> str:
    doc = inspect.getdoc(cls) or ""
    return " ".join(doc.split("\n\n")[0].split())


def _table(
    cls: type, prefix: str, skip: tuple[str, ...] = (), defaults: dict[str, str] | None = None
) -> list[str]:
    hints = typing.get_type_hints(cls)
    comments = field_comments(cls)
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        if not f.init or f.name.startswith("_") or f.name in skip:
            continue
        meaning = comments.get(f.name, "").replace("|", "\\|")
        tp = _type_name(hints[f.name])
        default = (defaults or {}).get(f.name) or _default(f)
        rows.append(f"| `{prefix}{f.name}` | {tp} | {default} | {meaning} |")
    return rows


def _section_type(tp: Any) -> type | None:
    """The dataclass a field holds (``X`` or ``X | None``), else None."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        tp = args[0] if len(args) == 1 else None
    return tp if isinstance(tp, type) and dataclasses.is_dataclass(tp) else None


def sections() -> list[tuple[str, type, tuple[str, ...]]]:
    """``(key prefix, dataclass, fields left out)`` for every section of the reference."""
    from jaxrl.config.run import RunConfig
    from jaxrl.config.sections.model import MODEL_SECTION_KEYS
    from jaxrl.models.model_config import ModelConfig

    out: list[tuple[str, type, tuple[str, ...]]] = []
    top = []
    hints = typing.get_type_hints(RunConfig)
    for f in dataclasses.fields(RunConfig):
        if not f.init:
            continue
        tp = _section_type(hints[f.name])
        if tp is not None:
            out.append((f"{f.name}.", tp, tuple(getattr(tp, "RUN_FIELDS", ()))))
            sub_hints = typing.get_type_hints(tp)  # a section's own sections (model.lora)
            for g in dataclasses.fields(tp):
                sub = _section_type(sub_hints[g.name])
                if sub is not None:
                    skip = tuple(getattr(sub, "RUN_FIELDS", ()))
                    out.append((f"{f.name}.{g.name}.", sub, skip))
        else:
            top.append(f.name)
    skip_top = tuple(f.name for f in dataclasses.fields(RunConfig) if f.name not in top)
    out.insert(0, ("", RunConfig, skip_top))
    # dtypes, the head and the kernels come from the `model` section itself, not model.init
    out.append(("model.init.", ModelConfig, MODEL_SECTION_KEYS))
    return out


def _tiny_defaults() -> dict[str, str]:
    """``model.init`` defaults: the tiny CPU shape; the vocabulary is the tokenizer's size."""
    from jaxrl.models.model_config import ModelConfig

    tiny = ModelConfig.tiny(1)
    out = {f.name: f"`{getattr(tiny, f.name)!r}`" for f in dataclasses.fields(ModelConfig)}
    out["vocab_size"] = "the tokenizer's size"
    out["head_dim"] = "`None`"
    return out


def render() -> str:
    """The whole reference page as markdown."""
    parts = [HEADER]
    for prefix, cls, skip in sections():
        title = prefix.rstrip(".") or "top level"
        parts.append(f"## `{title}`\n")
        doc = _doc(cls)
        if prefix == "model.init.":
            doc = (
                "The shape of a model trained from scratch (no `model.path`), in transformers' "
                "config names; fields left out take the tiny CPU shape (`ModelConfig.tiny`). " + doc
            )
        if doc:
            parts.append(doc + "\n")
        defaults = _tiny_defaults() if prefix == "model.init." else None
        parts.append("\n".join(_table(cls, prefix, skip, defaults)) + "\n")
        removed = getattr(cls, "REMOVED_FIELDS", {})
        if removed:
            parts.append("Removed keys (setting one is an error that says this):\n")
            lines = [f"- `{prefix}{k}`: {f.removeprefix('removed: ')}" for k, f in removed.items()]
            parts.append("\n".join(lines) + "\n")
    return re.sub(r"\n{3,}", "\n\n", "\n".join(parts))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write {DOC_PATH}")
    args = parser.parse_args(argv)
    text = render()
    if args.write:
        DOC_PATH.parent.mkdir(parents=True, exist_ok=True)
        DOC_PATH.write_text(text)
        print(f"wrote {DOC_PATH}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
