"""The inputs of ``GRPOTrainer.train_on_rollouts`` (rollouts generated elsewhere, e.g. by vLLM
or SGLang), checked row by row before they take the trainer's path: one ``ValueError`` naming
the row and the fix."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxrl.rollout.rewards.compute import check_reward

__all__ = ["check_rollouts", "external_batch", "reward_rows"]

LOGPROB_TOLERANCE = 1e-3  # sampler log-probs may exceed 0 by this much (rounding in the sampler)


def _token_rows(what: str, rows: Sequence[Any], vocab_size: int) -> list[np.ndarray]:
    """``rows`` as 1-D integer arrays, or ``ValueError`` naming the row."""
    out = []
    for i, ids in enumerate(rows):
        arr = np.asarray(ids)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise ValueError(
                f"train_on_rollouts: {what}[{i}] is not a list of token ids (got "
                f"{arr.dtype} {arr.shape}): give one list of ints per rollout"
            )
        if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
            raise ValueError(
                f"train_on_rollouts: {what}[{i}] holds ids outside [0, {vocab_size}) "
                f"(min {arr.min()}, max {arr.max()}): use the trainer's tokenizer"
            )
        out.append(arr)
    return out


def check_rollouts(
    prompt_tokens: Sequence[Any],
    completion_tokens: Sequence[Any],
    sampler_logprobs: Sequence[Any],
    rewards: Any,
    truncated: Sequence[bool] | None,
    *,
    vocab_size: int,
) -> None:
    """``train_on_rollouts``' inputs, or ``ValueError`` naming the row: one entry of each per
    rollout, token ids in the vocabulary, and one finite sampler log-prob ``<= 0`` (within
    ``LOGPROB_TOLERANCE``) per completion token."""
    n = len(completion_tokens)
    counts = {"prompt_tokens": len(prompt_tokens), "sampler_logprobs": len(sampler_logprobs)}
    counts["rewards"] = len(rewards)
    if truncated is not None:
        counts["truncated"] = len(truncated)
    for what, count in counts.items():
        if count != n:
            raise ValueError(
                f"train_on_rollouts: {count} {what} rows for {n} completion_tokens rows: give one "
                "per rollout"
            )
    _token_rows("prompt_tokens", prompt_tokens, vocab_size)
    completions = _token_rows("completion_tokens", completion_tokens, vocab_size)
    for i, (ids, logps) in enumerate(zip(completions, sampler_logprobs, strict=True)):
        try:
            lp = np.asarray(logps, np.float64)
        except (TypeError, ValueError):
            lp = None
        if lp is None or lp.ndim != 1 or lp.size != ids.size:
            got = "is not a list of numbers" if lp is None or lp.ndim != 1 else f"has {lp.size}"
            raise ValueError(
                f"train_on_rollouts: sampler_logprobs[{i}] {got}: give one log-prob per "
                f"completion token ({ids.size} in completion_tokens[{i}])"
            )
        bad = np.flatnonzero(~np.isfinite(lp) | (lp > LOGPROB_TOLERANCE))
        if bad.size:
            j = int(bad[0])
            raise ValueError(
                f"train_on_rollouts: sampler_logprobs[{i}][{j}] = {lp[j]:g} is not a "
                f"log-probability (finite and <= 0; {bad.size} such value(s) in row {i}): give "
                "the sampler's log-probs of the sampled tokens, not logits or probabilities"
            )


def reward_rows(rewards: Any) -> np.ndarray:
    """float64 ``[B, F]`` rewards of ``[B]`` or ``[B, F]`` rows (None = NaN, unscored), each
    checked (``check_reward``)."""
    r_BW = np.asarray(
        [[np.nan if v is None else v for v in np.atleast_1d(row)] for row in rewards],
        np.float64,
    )
    for (row, col), value in np.ndenumerate(r_BW):
        check_reward(value, f"train_on_rollouts: rewards[{row}][{col}] = {value:g}")
    return r_BW


def external_batch(
    generator: Any,
    params: Any,
    tokenizer: Any,
    vocab_size: int,
    prompt_tokens: Sequence[Sequence[int]],
    completion_tokens: Sequence[Sequence[int]],
    sampler_logprobs: Sequence[Sequence[float]],
    rewards: Any,
    truncated: Sequence[bool] | None,
) -> Any:
    """The ``RolloutBatch`` of checked external rollouts (token ids below ``vocab_size``), built
    by the run's ``generator`` (advantages, reference / old log-probs under ``params``);
    ``truncated`` defaults to "does not end in EOS"."""
    check_rollouts(
        prompt_tokens,
        completion_tokens,
        sampler_logprobs,
        rewards,
        truncated,
        vocab_size=vocab_size,
    )
    r_BW = reward_rows(rewards)
    if truncated is None:
        eos = tokenizer.eos_id
        truncated = [len(c) == 0 or int(c[-1]) != eos for c in completion_tokens]
    return generator.build(
        params,
        [np.asarray(p) for p in prompt_tokens],
        [np.asarray(c) for c in completion_tokens],
        [np.asarray(x) for x in sampler_logprobs],
        np.asarray(truncated, bool),
        r_BW,
    )
