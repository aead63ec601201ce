"""Completions of a trained policy, from Python: ``jaxrl.sample(model_dir, prompts)``.

A notebook's (or a script's) way to see what a model writes, or to produce rollouts for
``GRPOTrainer.train_on_rollouts`` as an external engine would: the same continuous-batching
sampler the trainers generate with (``jaxrl.generate.sampler.Sampler``), on a model directory
(an export such as ``summary["hf_export"]``) or a loaded model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["Samples", "sample"]


@dataclasses.dataclass(frozen=True)
class Samples:
    """One completion per prompt (host numpy), in the prompts' order."""

    prompt_ids: list[np.ndarray]  # int32 [P_b]: each prompt's tokens as the trainers tokenise it
    completion_ids: list[np.ndarray]  # int32 [N_b]: generated ids, eos included
    logprobs: list[np.ndarray]  # float32 [N_b]: the sampler's log-prob of each generated id
    texts: list[str]  # the completions decoded (special tokens dropped)
    truncated: np.ndarray  # bool [B]: stopped by max_new_tokens, without eos


def sample(
    model: str | Path | Any,
    prompts: Sequence[str | Sequence[Mapping[str, Any]] | Sequence[int]],
    *,
    tokenizer: Any = None,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
) -> Samples:
    """Sample one completion per prompt from ``model``: a local HF directory (tokenizer read
    from it) or a loaded ``jaxrl.models`` model (then pass ``tokenizer``). A prompt is a string,
    a conversation (``[{role, content}, ...]``, rendered with the chat template) or token ids.
    ``temperature=0`` is greedy decoding; ``seed`` fixes the random bits of a sampled call."""
    import jax

    from jaxrl.data import load_tokenizer
    from jaxrl.data.documents import prompt_ids
    from jaxrl.generate.sampler import Sampler, SamplingParams
    from jaxrl.models import from_pretrained

    if isinstance(model, str | Path):
        tokenizer = tokenizer or load_tokenizer(model)
        model = from_pretrained(model)
    if tokenizer is None:
        raise ValueError("sample: pass tokenizer= with a loaded model (a directory has its own)")
    if not prompts:
        raise ValueError("sample: give at least one prompt")
    ids = [
        np.asarray(
            p if _is_token_ids(p) else prompt_ids(tokenizer, p),  # type: ignore[arg-type]
            np.int32,
        )
        for p in prompts
    ]
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    sampler = Sampler(
        model.config,
        max_new_tokens=max_new_tokens,
        eos_id=tokenizer.eos_id,
        pad_id=tokenizer.pad_id,
        sampling=sampling,
    )
    sampler.load_params(model)
    result = sampler.generate(ids, jax.random.key(seed), sampling)
    completions = result.completions()
    return Samples(
        prompt_ids=ids,
        completion_ids=completions,
        logprobs=[result.logprobs[b, : len(c)] for b, c in enumerate(completions)],
        texts=[tokenizer.decode(c) for c in completions],
        truncated=np.asarray(result.truncated, bool),
    )


def _is_token_ids(prompt: Any) -> bool:
    return not isinstance(prompt, str) and all(isinstance(t, int | np.integer) for t in prompt)
