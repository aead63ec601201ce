"""The weights vLLM servers run: jaxrl's HF export (``jaxrl.models.hf``), the output head untied.

vLLM's in-place reload (vLLM 0.32) loads the embedding of a model with ``tie_word_embeddings``
but leaves its output head with the old weights, so the servers always run the head as its own
``lm_head.weight`` (a copy of the embedding) and the checkpoint says ``tie_word_embeddings:
false``. :func:`untied` is that rule, once; the disk export (:func:`export_weights`), the
tensors a GPU transfer sends (:func:`hf_tensors`) and their declared shapes
(``transfer.JaxWeights.metadata``) all go through it.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import jax
from flax import nnx
from safetensors.numpy import load_file, save_file

from jaxrl.models.hf import hf_arrays, save_pretrained

__all__ = ["EMBEDDING", "HEAD", "export_weights", "hf_tensors", "untied"]

EMBEDDING = "model.embed_tokens.weight"
HEAD = "lm_head.weight"
T = TypeVar("T")


def untied(tensors: Iterable[tuple[str, T]], tied: bool) -> Iterator[tuple[str, T]]:
    """``tensors`` (name, value) in their order and, when the head is ``tied``, then the output
    head as its own ``lm_head.weight`` with the embedding's value (module doc)."""
    embedding = None
    for name, value in tensors:
        if name == EMBEDDING:
            embedding = value
        yield name, value
    if tied:
        if embedding is None:
            raise ValueError(f"untied: a tied head needs {EMBEDDING}, which the tensors lack")
        yield HEAD, embedding


def _model(graphdef: Any, params: Any) -> Any:
    if isinstance(params, nnx.Module):
        params = nnx.state(params, nnx.Param)
    return nnx.merge(graphdef, params)


def hf_tensors(graphdef: Any, params: Any, *, dtype: str) -> Iterator[tuple[str, jax.Array]]:
    """The tensors :func:`export_weights` writes, as JAX arrays: its names, layout and dtype,
    the head untied."""
    model = _model(graphdef, params)
    yield from untied(hf_arrays(model, dtype=dtype), model.config.tie_word_embeddings)


def export_weights(
    graphdef: Any, params: Any, path: str | os.PathLike[str], *, dtype: str, eos_ids, pad_id
) -> Path:
    """Write ``params`` (an ``nnx.State`` or a model) as a HF checkpoint in ``path``, the head
    untied, complete or not at all: written into a sibling directory, renamed into place at
    the end."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model = _model(graphdef, params)
    eos = list(eos_ids)
    generation = {"eos_token_id": eos[0] if len(eos) == 1 else eos, "pad_token_id": int(pad_id)}
    try:
        save_pretrained(model, tmp, dtype=dtype, generation_config=generation)
        if model.config.tie_word_embeddings:
            _untie_checkpoint(tmp)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def _untie_checkpoint(path: Path) -> None:
    """The checkpoint in ``path`` with its tied head written out (:func:`untied`)."""
    tensors = dict(untied(load_file(str(path / "model.safetensors")).items(), tied=True))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
