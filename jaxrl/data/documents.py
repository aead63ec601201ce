"""Validated dataset rows → token documents for the trainers (docs/data.md).

A prompt and its completion (an SFT prompt/completion row, a DPO prompt and one response, a GRPO
prompt and a sampled completion) make one document through :func:`prompt_completion_document`:
``prompt + completion`` ids and a token-aligned loss mask (value i belongs to token i).

Text rows: ``[bos]`` (when the tokenizer adds one to plain text, ``add_bos_token``) + the
prompt, then the completion + ``eos``. Conversational rows go through the chat template: a
prompt is rendered with the generation prompt, and a completion is the continuation of
rendering prompt + completion (checked: the full render starts with the prompt's), as TRL does.

Length limits are applied as TRL's trainers apply them, and every row they touch is counted
(``over_length``; rows left with nothing to train on are ``dropped`` and counted too), so the
trainers can report them (``data/train_over_length``, ``data/train_dropped``):

- SFT: a document longer than ``sft.max_length`` keeps its first ``max_length`` tokens.
- DPO: a prompt longer than ``dpo.max_prompt_length`` keeps its last tokens; then a response
  that does not fit ``dpo.max_length`` with its prompt keeps its first tokens. A pair whose
  prompt leaves no room for a response token is dropped.
- GRPO: a prompt longer than ``max_prompt_length`` keeps its last tokens.

The built-in tasks' rows (``jaxrl.data.tasks``) take the same path and the same limits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxrl.data.batching.preference import PairDocuments
from jaxrl.data.chat_template import ChatTemplateError
from jaxrl.data.datasets import DataError, Dataset
from jaxrl.data.tokenizer import TextTokenizer, UnknownTextError

__all__ = [
    "LengthReport",
    "PromptDocuments",
    "SFTDocuments",
    "completion_field",
    "dpo_documents",
    "grpo_prompts",
    "prompt_completion_document",
    "prompt_ids",
    "sft_documents",
]


def prompt_completion_document(
    prompt: Sequence[int] | np.ndarray,
    completion: Sequence[int] | np.ndarray,
    *,
    prompt_loss: float = 0.0,
    completion_loss: float = 1.0,
) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, loss_mask)`` of one prompt + completion document: int32 ids, and a float32
    token-aligned mask that is ``prompt_loss`` on the prompt's tokens and ``completion_loss`` on
    the completion's (``jaxrl.data.batching.packing`` shifts it into target alignment)."""
    p, c = np.asarray(prompt, np.int32), np.asarray(completion, np.int32)
    ids = np.concatenate([p.reshape(-1), c.reshape(-1)])
    mask = np.concatenate(
        [np.full(p.size, prompt_loss, np.float32), np.full(c.size, completion_loss, np.float32)]
    )
    return ids, mask


def completion_field(num_prompt_tokens: int, values: Sequence[float] | np.ndarray) -> np.ndarray:
    """Per-completion-token ``values`` (e.g. log-probs) aligned to the tokens of the prompt +
    completion document: float32, 0 on the prompt."""
    zeros = np.zeros(num_prompt_tokens, np.float32)
    return np.concatenate([zeros, np.asarray(values, np.float32).reshape(-1)])


@dataclasses.dataclass(frozen=True)
class LengthReport:
    """Rows the length limits touched: ``over_length`` truncated (or dropped), ``dropped``
    left out because nothing trainable remained. ``metrics(prefix)`` names them for logs."""

    rows: int  # rows read
    over_length: int = 0  # rows longer than a limit
    dropped: int = 0  # of those, rows left out (no trainable token left)

    def metrics(self, split: str) -> dict[str, int]:
        return {
            f"data/{split}_over_length": self.over_length,
            f"data/{split}_dropped": self.dropped,
        }

    def warning(self, split: str, limits: str) -> str | None:
        """One line for the console, or None when no row was touched."""
        if not self.over_length:
            return None
        return (
            f"warning: {self.over_length} of {self.rows} {split} rows exceed {limits}: truncated"
            + (f", {self.dropped} dropped (nothing left to train on)" if self.dropped else "")
        )


@dataclasses.dataclass(frozen=True)
class SFTDocuments:
    """SFT documents: token ids and token-aligned loss masks (1 = trained on)."""

    sequences: list[np.ndarray]  # int32 per document
    masks: list[np.ndarray]  # float32 per document
    report: LengthReport
    rows: list[int]  # the dataset row of every document (dropped rows are absent)


@dataclasses.dataclass(frozen=True)
class PromptDocuments:
    """GRPO prompts: token ids per row (all rows kept; long ones left-truncated)."""

    ids: list[np.ndarray]  # int32 per row
    report: LengthReport


def _in_row(where: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run ``fn``; a chat-template error gets the row's location."""
    try:
        return fn(*args, **kwargs)
    except (ChatTemplateError, UnknownTextError) as e:
        raise DataError(f"{where}: {e}") from None


def prompt_ids(
    tok: TextTokenizer,
    prompt: str | Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[int]:
    """A prompt's tokens: ``[bos]`` (when the tokenizer adds one to plain text) + the text, or a
    conversation rendered with the chat template and its generation prompt (and the ``tools``
    schemas the policy may call, docs/tools.md)."""
    if isinstance(prompt, str):
        return tok.encode(prompt, add_bos=tok.add_bos_token)
    return tok.apply_chat_template(prompt, add_generation_prompt=True, tools=tools)


def _completion_ids(
    tok: TextTokenizer,
    prompt: str | Sequence[Mapping[str, Any]],
    prompt_tokens: list[int],
    completion: str | Sequence[Mapping[str, Any]],
    key: str,
) -> list[int]:
    """The completion's tokens: text + eos, or the continuation of the full conversation."""
    if isinstance(completion, str):
        return tok.encode(completion) + [tok.eos_id]
    full = tok.apply_chat_template(list(prompt) + list(completion), add_generation_prompt=False)
    if full[: len(prompt_tokens)] != prompt_tokens:
        raise ChatTemplateError(
            f"the chat template of {tok.chat_template().origin} renders prompt + {key!r} so "
            "that it does not start with the prompt rendered with a generation prompt; the "
            f"{key!r} tokens cannot be located"
        )
    return full[len(prompt_tokens) :]


def sft_documents(
    data: Dataset, tok: TextTokenizer, *, max_length: int, completion_only_loss: bool
) -> SFTDocuments:
    """SFT documents of every row. ``completion_only_loss``: loss on completions (prompt /
    completion rows) or assistant turns (``messages`` rows, content and end-of-turn token)
    only; ``text`` rows always train on every token. Documents over ``max_length`` keep their
    first ``max_length`` tokens; one left with no loss token is dropped (both counted)."""
    if data.kind != "sft":
        raise ValueError(f"sft_documents needs an SFT dataset, got kind={data.kind!r}")
    sequences, masks, kept = [], [], []
    over = dropped = 0
    for i, (row, at) in enumerate(zip(data.rows, data.where, strict=True)):
        if data.format == "messages":
            if completion_only_loss:
                if not any(m.get("role") == "assistant" for m in row["messages"]):
                    raise DataError(
                        f"{at}: 'messages' has no assistant turn, so there is nothing to train "
                        "on with sft.completion_only_loss=true"
                    )
                ids, mask = _in_row(at, tok.chat_assistant_mask, row["messages"])
            else:
                ids = _in_row(at, tok.apply_chat_template, row["messages"], False)
                mask = [1] * len(ids)
        elif data.format == "prompt_completion":
            prompt = _in_row(at, prompt_ids, tok, row["prompt"])
            completion = _in_row(
                at, _completion_ids, tok, row["prompt"], prompt, row["completion"], "completion"
            )
            ids, mask = prompt_completion_document(
                prompt, completion, prompt_loss=0.0 if completion_only_loss else 1.0
            )
        else:  # text
            ids = tok.encode(row["text"], add_bos=tok.add_bos_token) + [tok.eos_id]
            mask = [1] * len(ids)
        if len(ids) > max_length:
            over += 1
            ids, mask = ids[:max_length], mask[:max_length]
            if sum(mask[1:]) == 0:  # the first token is never predicted
                dropped += 1
                continue
        sequences.append(np.asarray(ids, np.int32))
        masks.append(np.asarray(mask, np.float32))
        kept.append(i)
    if not sequences:
        raise DataError(
            f"{data.source}: every row was dropped by sft.max_length={max_length} (no "
            "completion token left); raise sft.max_length"
        )
    report = LengthReport(rows=len(data), over_length=over, dropped=dropped)
    return SFTDocuments(sequences, masks, report, kept)


def dpo_documents(
    data: Dataset,
    tok: TextTokenizer,
    *,
    max_length: int,
    max_prompt_length: int | None = None,
    max_tokens: int | None = None,
) -> tuple[PairDocuments, LengthReport, list[int]]:
    """``(pairs, report, rows)``: pair p's chosen and rejected documents (``2p``, ``2p + 1``;
    ``prompt + response``, the mask 1 on the response), the length report, and the dataset row
    of every kept pair. Raises ``DataError`` naming the row when a pair cannot fit one
    micro-batch row of ``max_tokens`` (chosen and rejected share a row)."""
    if data.kind != "dpo":
        raise ValueError(f"dpo_documents needs a DPO dataset, got kind={data.kind!r}")
    sequences: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    lengths: list[int] = []
    kept: list[int] = []
    over = dropped = 0
    for i, (row, at) in enumerate(zip(data.rows, data.where, strict=True)):
        prompt = _in_row(at, prompt_ids, tok, row["prompt"])
        responses = [
            _in_row(at, _completion_ids, tok, row["prompt"], prompt, row[key], key)
            for key in ("chosen", "rejected")
        ]
        for key, response in zip(("chosen", "rejected"), responses, strict=True):
            if not response:
                raise DataError(f"{at}: {key!r} encodes to no tokens")
        touched = False
        if max_prompt_length is not None and len(prompt) > max_prompt_length:
            prompt, touched = prompt[-max_prompt_length:], True
        room = max_length - len(prompt)
        if any(len(r) > room for r in responses):
            touched = True
            responses = [r[: max(room, 0)] for r in responses]
        over += touched
        if room < 1:
            dropped += 1
            continue
        pair = 0
        for response in responses:
            ids, mask = prompt_completion_document(prompt, response)
            sequences.append(ids)
            masks.append(mask)
            pair += len(ids)
        if max_tokens is not None and pair > max_tokens:
            raise DataError(
                f"{at}: the pair has {len(sequences[-2])} + {len(sequences[-1])} = {pair} tokens "
                f"> schedule.max_tokens={max_tokens}; chosen and rejected share one row, so raise "
                "schedule.max_tokens to at least 2 × dpo.max_length, or lower dpo.max_length"
            )
        lengths.append(pair)
        kept.append(i)
    if not lengths:
        raise DataError(
            f"{data.source}: every pair was dropped: no prompt leaves room for a response "
            f"within dpo.max_length={max_length}; raise it or set dpo.max_prompt_length"
        )
    report = LengthReport(rows=len(data), over_length=over, dropped=dropped)
    return PairDocuments(sequences, masks, np.asarray(lengths, np.int64)), report, kept


def grpo_prompts(
    data: Dataset,
    tok: TextTokenizer,
    *,
    max_prompt_length: int,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> PromptDocuments:
    """Prompt ids of every GRPO row (chat template with the generation prompt, and ``tools``,
    for messages); a prompt over ``max_prompt_length`` keeps its last tokens (TRL), counted in
    the report."""
    if data.kind != "grpo":
        raise ValueError(f"grpo_prompts needs a GRPO dataset, got kind={data.kind!r}")
    ids, over = [], 0
    for row, at in zip(data.rows, data.where, strict=True):
        prompt = _in_row(at, prompt_ids, tok, row["prompt"], tools)
        if len(prompt) > max_prompt_length:
            over += 1
            prompt = prompt[-max_prompt_length:]
        ids.append(np.asarray(prompt, np.int32))
    return PromptDocuments(ids, LengthReport(rows=len(data), over_length=over))
