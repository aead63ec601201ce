"""Reading datasets in TRL's formats: local JSONL / JSON / Parquet files, ``save_to_disk``
directories, or (not a local path) a ``datasets.load_dataset`` name.

Rows come back as plain dicts with the location of each (``file:line`` for JSONL and JSON
arrays, ``file row i`` for Parquet and Arrow, 0-based), so every later error names the row.
The formats (docs/data.md), per trainer:

- GRPO (prompt-only): ``prompt``, a string or a list of ``{role, content}`` messages; every other
  column is kept for the reward functions.
- SFT: ``messages`` (a conversation), or ``prompt`` + ``completion`` (both strings, or both
  message lists), or ``text``.
- DPO: ``prompt`` + ``chosen`` + ``rejected`` (strings, or message lists); or, conversational
  only, ``chosen`` + ``rejected`` alone (TRL's implicit prompt: the messages the two share from
  the start are the prompt).

Every problem is a ``DataError`` (a ``ValueError``) that names the file, the line or row, the
value and what to do.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from jaxrl.runtime import storage

Kind = Literal["grpo", "sft", "dpo"]
KINDS: tuple[str, ...] = ("grpo", "sft", "dpo")
MAX_DEPTH = 32  # deepest nesting of lists/objects a row may have
JSONL_SUFFIXES = (".jsonl", ".ndjson")
FILE_SUFFIXES = (*JSONL_SUFFIXES, ".json", ".parquet")

__all__ = ["DataError", "Dataset", "read_dataset", "read_rows", "rows_dataset"]


class DataError(ValueError):
    """A data file or row is unusable; the message starts with ``file:line`` (or ``file row
    i``) and says what is wrong and how to fix it."""


@dataclasses.dataclass(frozen=True)
class Dataset:
    """Validated rows of one split, in file order.

    ``format``: ``"prompt"`` (GRPO), ``"messages"``, ``"prompt_completion"`` or ``"text"`` (SFT),
    ``"preference"`` (DPO; implicit prompts are made explicit); ``conversational``: rows hold
    message lists (rendered with the chat template) rather than strings.
    """

    source: str  # the path or dataset name as given
    split: str  # the split read (directories and hub datasets), or "" for a file
    kind: str  # "grpo", "sft" or "dpo"
    format: str
    conversational: bool
    rows: list[dict[str, Any]]  # plain dicts
    where: list[str]  # "file:line" / "file row i" of every row, for errors

    def __len__(self) -> int:
        return len(self.rows)


# -- reading --------------------------------------------------------------------------------


def _line_of(data: bytes | str, offset: int) -> int:
    return data.count(b"\n" if isinstance(data, bytes) else "\n", 0, offset) + 1


def _json_value(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: bad JSON ({e.msg}: column {e.colno})") from None
    except RecursionError:
        raise DataError(f"{where}: the value is nested too deeply to read") from None


def _read_jsonl(path: Path, data: bytes) -> tuple[list[Any], list[str]]:
    rows, where = [], []
    for lineno, raw in enumerate(data.split(b"\n"), start=1):
        at = f"{path}:{lineno}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(
                f"{at}: not UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1}); "
                "re-encode the file as UTF-8"
            ) from None
        if not line.strip():
            continue
        rows.append(_json_value(line, at))
        where.append(at)
    return rows, where


def _read_json(path: Path, data: bytes) -> tuple[list[Any], list[str]]:
    """A JSON array of objects (each row's location is the line it starts on); a ``.json`` file
    that holds one object per line (what ``Dataset.to_json`` writes) is read as JSONL."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = _line_of(data, e.start)
        raise DataError(
            f"{path}:{line}: not UTF-8 (byte {data[e.start]:#04x}); re-encode the file as UTF-8"
        ) from None
    start = len(text) - len(text.lstrip())
    if not text[start:].startswith("["):
        return _read_jsonl(path, data)
    decoder = json.JSONDecoder()
    rows, where = [], []
    i = start + 1
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            if text[i] == "," and not rows:
                raise DataError(f"{path}:{_line_of(text, i)}: bad JSON (a ',' before any value)")
            i += 1
        if i >= len(text):
            raise DataError(f"{path}:{_line_of(text, i)}: bad JSON (the array is not closed)")
        if text[i] == "]":
            break
        at = f"{path}:{_line_of(text, i)}"
        try:
            value, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{e.lineno}: bad JSON ({e.msg}: column {e.colno})") from None
        except RecursionError:
            raise DataError(f"{at}: the value is nested too deeply to read") from None
        rows.append(value)
        where.append(at)
    if text[i + 1 :].strip():
        raise DataError(f"{path}:{_line_of(text, i + 1)}: bad JSON (extra data after the array)")
    return rows, where


def _read_parquet(path: Path) -> tuple[list[Any], list[str]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ...
        raise DataError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e})") from None
    rows = table.to_pylist()
    return rows, [f"{path} row {i}" for i in range(len(rows))]


def _pick_split(obj: Any, source: str, split: str) -> Any:
    import datasets

    if isinstance(obj, datasets.DatasetDict):
        if split not in obj:
            raise DataError(
                f"{source}: no split {split!r}; it has {sorted(obj.keys())}: set data.split "
                "(or data.eval_split) to one of them"
            )
        return obj[split]
    return obj


def _read_disk(path: Path, split: str) -> tuple[list[Any], list[str]]:
    import datasets

    try:
        obj = datasets.load_from_disk(str(path))
    except Exception as e:  # not a save_to_disk directory, damaged files, ...
        raise DataError(
            f"{path}: not a directory written by datasets' save_to_disk ({type(e).__name__}: "
            f"{e}); give a JSONL, JSON or Parquet file or a save_to_disk directory"
        ) from None
    ds = _pick_split(obj, str(path), split)
    rows = ds.to_list()
    return rows, [f"{path} row {i}" for i in range(len(rows))]


def _read_hub(name: str, split: str) -> tuple[list[Any], list[str]]:
    import datasets

    try:
        ds = datasets.load_dataset(name, split=split)
    except Exception as e:
        raise DataError(
            f"{name!r} is not a local file or directory, and datasets.load_dataset({name!r}, "
            f"split={split!r}) failed ({type(e).__name__}: {e}); check the path"
        ) from None
    rows = ds.to_list()
    return rows, [f"{name}[{split}] row {i}" for i in range(len(rows))]


def read_rows(source: str | Path, *, split: str = "train") -> tuple[list[Any], list[str], str]:
    """``(rows, where, split)``: every row of a file, a ``save_to_disk`` directory (a
    ``DatasetDict``'s ``split``) or a hub dataset, with its location. ``split`` comes back as
    "" for a file (files have no splits). Raises ``DataError``; an empty source is one."""
    path = Path(storage.local(source)) if storage.is_remote(source) else Path(source)
    if path.is_dir():
        rows, where = _read_disk(path, split)
    elif path.is_file():
        suffix = path.suffix.lower()
        if suffix == ".parquet":
            rows, where = _read_parquet(path)
        elif suffix in JSONL_SUFFIXES or suffix == ".json":
            data = path.read_bytes()
            rows, where = (_read_jsonl if suffix in JSONL_SUFFIXES else _read_json)(path, data)
        else:
            raise DataError(
                f"{path}: unknown data file type {suffix!r}; use .jsonl, .json or .parquet (or a "
                "save_to_disk directory)"
            )
        split = ""
    elif path.suffix.lower() in FILE_SUFFIXES or str(source).startswith((".", "/", "~")):
        raise DataError(f"{source}: no such file or directory")
    else:
        rows, where = _read_hub(str(source), split)
    if not rows:
        raise DataError(f"{source}: no rows (the data is empty)")
    return rows, where, split


# -- validation -----------------------------------------------------------------------------


def _depth(value: Any, limit: int) -> int:
    """Nesting depth of lists/dicts, stopping past ``limit``."""
    if limit < 0 or not isinstance(value, list | dict):
        return 0
    children = value.values() if isinstance(value, dict) else value
    return 1 + max((_depth(v, limit - 1) for v in children), default=0)


def _check_messages(value: list, key: str, at: str) -> None:
    for i, m in enumerate(value):
        if not isinstance(m, Mapping):
            raise DataError(
                f"{at}: {key!r}[{i}] must be a {{role, content}} message, got {type(m).__name__}"
            )
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise DataError(f"{at}: {key!r}[{i}] has no 'role' (a string: system/user/assistant)")
        content = m.get("content")
        if content is not None and not isinstance(content, str | list):
            raise DataError(
                f"{at}: {key!r}[{i}]['content'] must be a string, got {type(content).__name__}"
            )
        if content is None and not m.get("tool_calls"):
            raise DataError(f"{at}: {key!r}[{i}] ({role}) has no 'content'")


def _text_or_messages(row: Mapping, key: str, at: str, needed_for: str) -> bool:
    """Check ``row[key]`` is a non-empty string or message list; True for messages."""
    if key not in row or row[key] is None:
        raise DataError(f"{at}: missing {key!r} ({needed_for})")
    value = row[key]
    if isinstance(value, str):
        return False
    if isinstance(value, list) and value:
        _check_messages(value, key, at)
        return True
    got = "an empty list" if isinstance(value, list) else type(value).__name__
    raise DataError(
        f"{at}: {key!r} must be a string or a list of {{role, content}} messages, got {got}"
    )


def _implicit_prompt(row: dict, at: str) -> dict:
    """TRL's ``extract_prompt``: the messages chosen and rejected share from the start become
    the prompt; the rest are the responses."""
    chosen, rejected = row["chosen"], row["rejected"]
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    if n == 0 or n == len(chosen) or n == len(rejected):
        raise DataError(
            f"{at}: no 'prompt', and 'chosen'/'rejected' do not share a leading conversation "
            "that both continue; give an explicit 'prompt'"
        )
    return {**row, "prompt": chosen[:n], "chosen": chosen[n:], "rejected": rejected[n:]}


def _validate(kind: str, row: Any, at: str) -> tuple[str, bool, dict]:
    """``(format, conversational, row)`` of one row, or ``DataError``."""
    if not isinstance(row, dict):
        raise DataError(f"{at}: a row must be a JSON object, got {type(row).__name__}")
    if _depth(row, MAX_DEPTH) > MAX_DEPTH:
        raise DataError(f"{at}: the row is nested deeper than {MAX_DEPTH} levels; flatten it")
    if kind == "grpo":
        conv = _text_or_messages(
            row, "prompt", at, "a GRPO row needs a prompt: string or list of messages"
        )
        return "prompt", conv, row
    if kind == "sft":
        if "messages" in row:
            if not _text_or_messages(row, "messages", at, "a conversation"):
                raise DataError(
                    f"{at}: 'messages' must be a list of {{role, content}} messages, "
                    "got str (use 'text' for plain text)"
                )
            return "messages", True, row
        if "prompt" in row or "completion" in row:
            need = "an SFT prompt/completion row needs both"
            conv_p = _text_or_messages(row, "prompt", at, need)
            conv_c = _text_or_messages(row, "completion", at, need)
            if conv_p != conv_c:
                raise DataError(
                    f"{at}: 'prompt' and 'completion' must both be strings or both be message lists"
                )
            return "prompt_completion", conv_p, row
        if "text" in row:
            value = row["text"]
            if not isinstance(value, str) or not value:
                got = "an empty string" if value == "" else type(value).__name__
                raise DataError(f"{at}: 'text' must be a non-empty string, got {got}")
            return "text", False, row
        raise DataError(
            f"{at}: missing 'messages', 'prompt'+'completion' or 'text' (an SFT row needs one "
            f"of TRL's formats); the row has {sorted(row)}"
        )
    # dpo
    need = "a DPO row needs prompt, chosen and rejected"
    conv_c = _text_or_messages(row, "chosen", at, need)
    conv_r = _text_or_messages(row, "rejected", at, need)
    if conv_c != conv_r:
        raise DataError(f"{at}: 'chosen' and 'rejected' must both be strings or both messages")
    if "prompt" not in row or row["prompt"] is None:
        if not conv_c:
            raise DataError(
                f"{at}: missing 'prompt' ({need}; only conversational rows may leave it out)"
            )
        return "preference", True, _implicit_prompt(row, at)
    conv_p = _text_or_messages(row, "prompt", at, need)
    if conv_p != conv_c:
        raise DataError(
            f"{at}: 'prompt' and 'chosen'/'rejected' must all be strings or all be message lists"
        )
    return "preference", conv_c, row


def _style(fmt: str, conversational: bool) -> str:
    return f"{fmt} ({'messages' if conversational else 'strings'})"


def read_dataset(source: str | Path, kind: Kind, *, split: str = "train") -> Dataset:
    """Read and validate a dataset for a trainer (``kind``: "grpo", "sft" or "dpo").

    Every row must have the same format (all ``messages``, all prompt/completion, ...; strings
    or messages alike); the first row sets it. Raises ``DataError`` naming the row.
    """
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}: use one of {KINDS}")
    raw, where, split = read_rows(source, split=split)
    return rows_dataset(raw, kind, source=str(source), split=split, where=where)


def rows_dataset(
    rows: list[Any],
    kind: Kind,
    *,
    source: str,
    split: str = "",
    where: list[str] | None = None,
) -> Dataset:
    """Validate rows already in memory (e.g. a built-in task's, ``jaxrl.data.tasks``) as
    :func:`read_dataset` validates a file's; ``where`` names each row for errors (default
    ``source[split] row i``)."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}: use one of {KINDS}")
    if where is None:
        where = [f"{source}[{split}] row {i}" for i in range(len(rows))]
    if not rows:
        raise DataError(f"{source}: no rows (the data is empty)")
    checked_rows: list[dict[str, Any]] = []
    fmt, conv = None, None
    for row, at in zip(rows, where, strict=True):
        f, c, checked = _validate(kind, row, at)
        if fmt is None:
            fmt, conv = f, c
        elif (f, c) != (fmt, conv):
            raise DataError(
                f"{at}: a {_style(f, c)} row in a {_style(fmt, conv)} dataset (set by "
                f"{where[0]}); "
                "use one format per dataset"
            )
        checked_rows.append(checked)
    return Dataset(
        source=source,
        split=split,
        kind=kind,
        format=fmt or "",
        conversational=bool(conv),
        rows=checked_rows,
        where=where,
    )
