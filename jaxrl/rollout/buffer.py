"""TRL's prompt order and generation buffer, on the host (TRL GRPOTrainer's RepeatSampler).

Notation: P ranks, b completions per rank per micro-step, G completions per prompt, S micro-steps
per generation buffer, μ passes over each buffer, g micro-steps per optimizer step,
``B_gen = b·P·S`` completions per generation. Section numbers (§) are those of
docs/algorithms/grpo.md.

Prompt order (TRL's ``RepeatSampler``, §3). Every epoch takes a seeded permutation of the prompt
indices (``jaxrl.data.feed.epoch_permutation``, the identity without shuffling), cuts it into
chunks of ``B_gen/G`` prompts and drops an incomplete last chunk. TRL emits each chunk ``μ·S``
times with every index repeated G times, and only the first copy is generated from;
:class:`PromptSampler` yields that first copy, one chunk per generation, without materialising
the repeats. Rank p generates rows ``[p·b·S, (p+1)·b·S)`` of the chunk's G-repeated rows
(:func:`rank_rows`). :func:`repeat_sampler_indices` materialises TRL's full index stream, as a
reference.

Generation buffer (§4). A micro-step counter k runs across epochs. When ``k % (S·μ) == 0`` or the
buffer is empty (:attr:`GenerationBuffer.needs_generation`), the trainer generates ``B_gen`` rows
and :meth:`GenerationBuffer.load` keeps each rank's ``b·S`` rows, applies ONE seeded numpy
permutation to every per-row field (the same permutation on every rank, as TRL's identically
seeded processes draw it), and cuts them into S chunks of b rows; 0-d fields are copied into
every chunk and None stays None. Micro-step k is served chunk ``k % S`` of every rank
(:meth:`GenerationBuffer.serve`), μ passes in chunk order with no reshuffle between passes.
An optimizer step is g consecutive micro-steps; windows and buffers need not align.

Old log-probs are needed iff some buffered row is served after an optimizer update, which is
``GRPOConfig.needs_old_logprobs`` (``g % (S·μ) != 0``, §5).

The permutation generator and the counter are host state: :meth:`GenerationBuffer.state_dict`
goes into every checkpoint, so a resumed run serves exactly the rows an uninterrupted one would.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from jaxrl.config.grpo import GRPOConfig
from jaxrl.data.feed import epoch_permutation

Batch = dict[str, Any]  # field → per-row array [N, ...], 0-d array / scalar, or None

__all__ = [
    "GenerationBuffer",
    "MicroStepRule",
    "PromptSampler",
    "rank_rows",
    "repeat_sampler_indices",
    "shuffle_batch",
    "split_batch",
]


@dataclasses.dataclass(frozen=True)
class MicroStepRule:
    """Which micro-steps make an optimizer step, and when a generation loads: written once, for
    the synchronous loop (``GRPOTrainer.step``), the buffer (:attr:`GenerationBuffer.
    needs_generation`) and the pipeline's forecast of the loads (:meth:`load_steps`).

    A step runs ``g`` micro-steps, or with ``docs_per_step`` as many as it takes to hold that
    many pending rows (each micro-step serves ``b · P``); it trains on ``docs_per_step`` of them.
    Micro-step k loads a generation when ``k % (S·μ) == 0`` (or the buffer is empty).
    """

    micro_steps_per_step: int  # g (without docs_per_step)
    docs_per_step: int  # 0: g micro-steps per step
    rows_per_micro_step: int  # b · P
    generation_period: int  # S · μ

    @classmethod
    def of(cls, config: GRPOConfig, docs_per_step: int) -> MicroStepRule:
        return cls(
            micro_steps_per_step=config.gradient_accumulation_steps,
            docs_per_step=docs_per_step,
            rows_per_micro_step=config.per_device_train_batch_size * (config.world_size or 1),
            generation_period=config.generation.steps * config.num_iterations,
        )

    def loads_generation(self, micro_step: int) -> bool:
        """Micro-step ``micro_step`` (counted over the run) starts by loading a generation."""
        return micro_step % self.generation_period == 0

    def continues(self, runs: int, pending: int) -> bool:
        """Whether the step runs another micro-step after ``runs`` of them, with ``pending``
        rows served and not yet trained on."""
        if self.docs_per_step == 0:
            return runs < self.micro_steps_per_step
        return pending < self.docs_per_step

    def run_step(self, micro_step: Callable[[], None], pending: Callable[[], int]) -> None:
        """One step's micro-steps: ``micro_step()`` until :meth:`continues` says no."""
        runs = 0
        while self.continues(runs, pending()):
            micro_step()
            runs += 1

    def load_steps(self) -> Iterator[int]:
        """The optimizer step (0-based) at which generation 0, 1, 2, ... loads. (With
        ``docs_per_step``, rows the schedule hands back to the next step make the real loads
        later, never earlier.)"""
        state = {"micro": 0, "pending": 0, "loads": 0}

        def micro_step() -> None:
            state["loads"] += self.loads_generation(state["micro"])
            state["micro"] += 1
            state["pending"] += self.rows_per_micro_step

        step = 0
        while True:
            before = state["loads"]
            self.run_step(micro_step, lambda: state["pending"])
            yield from [step] * (state["loads"] - before)
            state["pending"] -= self.docs_per_step
            step += 1


def repeat_sampler_indices(
    num_prompts: int,
    *,
    mini_repeat_count: int,
    batch_size: int,
    repeat_count: int = 1,
    shuffle: bool = True,
    seed: int = 0,
    epoch: int = 0,
) -> list[int]:
    """TRL's ``RepeatSampler`` index stream for one epoch, materialised (the reference).

    Chunks of ``batch_size`` prompts (an incomplete last chunk is dropped), each emitted
    ``repeat_count`` times with every index repeated ``mini_repeat_count`` times consecutively.
    Length ``floor(N / batch_size) · batch_size · mini_repeat_count · repeat_count``.
    """
    order = epoch_permutation(num_prompts, seed=seed, epoch=epoch, shuffle=shuffle)
    out: list[int] = []
    for start in range(0, num_prompts - batch_size + 1, batch_size):
        chunk = order[start : start + batch_size]
        for _ in range(repeat_count):
            out.extend(int(i) for i in np.repeat(chunk, mini_repeat_count))
    return out


def rank_rows(rank: int, *, per_device_batch: int, steps_per_generation: int) -> slice:
    """The rows of a generation batch (global order) that rank ``rank`` generates and keeps."""
    n = per_device_batch * steps_per_generation
    return slice(rank * n, (rank + 1) * n)


class PromptSampler:
    """The prompts of successive generation batches, in TRL ``RepeatSampler`` order.

    :meth:`next_generation` returns the ``B_gen`` prompt indices of the next generation (each
    unique prompt repeated G times, in global row order). The state is the epoch and the chunk
    within it; the permutation of epoch e is a function of ``(seed, e)``.
    """

    def __init__(
        self,
        num_prompts: int,
        *,
        prompts_per_generation: int,
        num_generations: int,
        shuffle: bool = True,
        seed: int = 0,
    ):
        if prompts_per_generation > num_prompts:
            raise ValueError(
                f"a generation needs {prompts_per_generation} distinct prompts (generation_"
                f"batch_size / num_generations) but the dataset has {num_prompts}; lower "
                "generation_batch_size or use more prompts"
            )
        self.num_prompts = num_prompts
        self.prompts_per_generation = prompts_per_generation
        self.num_generations = num_generations
        self.shuffle, self.seed = shuffle, seed
        self.epoch, self.chunk = 0, 0
        self.generations = 0  # generation batches handed out so far (all epochs)

    @property
    def chunks_per_epoch(self) -> int:
        """Complete chunks of ``B_gen/G`` prompts per epoch (the incomplete last one is dropped)."""
        return self.num_prompts // self.prompts_per_generation

    @property
    def epochs(self) -> float:
        """Passes over the prompts so far, as a float (``epoch`` in metrics rows)."""
        return self.epoch + self.chunk / max(self.chunks_per_epoch, 1)

    def next_generation(self) -> np.ndarray:
        """int64 ``[B_gen]``: the next chunk's prompt indices, each repeated G times."""
        if self.chunk == self.chunks_per_epoch:
            self.epoch, self.chunk = self.epoch + 1, 0
        order = epoch_permutation(
            self.num_prompts, seed=self.seed, epoch=self.epoch, shuffle=self.shuffle
        )
        n = self.prompts_per_generation
        chunk = order[self.chunk * n : (self.chunk + 1) * n]
        self.chunk += 1
        self.generations += 1
        return np.repeat(chunk, self.num_generations)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "chunk": self.chunk, "generations": self.generations}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.epoch, self.chunk = int(state["epoch"]), int(state["chunk"])
        self.generations = int(state["generations"])


def _rows(batch: Batch) -> int:
    sizes = {np.shape(v)[0] for v in batch.values() if v is not None and np.ndim(v) > 0}
    if len(sizes) != 1:
        raise ValueError(f"per-row fields must share one leading size, got {sorted(sizes)}")
    return sizes.pop()


def shuffle_batch(batch: Batch, rng: np.random.Generator) -> Batch:
    """One random row permutation applied to every per-row field; 0-d fields and None as is."""
    perm = rng.permutation(_rows(batch))
    return {k: v if v is None or np.ndim(v) == 0 else np.asarray(v)[perm] for k, v in batch.items()}


def split_batch(batch: Batch, num_chunks: int) -> list[Batch]:
    """``num_chunks`` contiguous row chunks; 0-d fields are copied into each, None stays None."""
    n = _rows(batch)
    if n % num_chunks:
        raise ValueError(f"{n} rows do not split into {num_chunks} equal chunks")
    size = n // num_chunks
    return [
        {
            k: v if v is None or np.ndim(v) == 0 else np.asarray(v)[i * size : (i + 1) * size]
            for k, v in batch.items()
        }
        for i in range(num_chunks)
    ]


def _encode(value: Any) -> Any:
    if value is None:
        return None
    arr = np.asarray(value)
    if arr.dtype == object:
        raise TypeError("buffer fields must be numeric arrays to be checkpointed")
    return {"dtype": arr.dtype.str, "shape": list(arr.shape), "data": arr.ravel().tolist()}


def _decode(value: Any) -> Any:
    if value is None:
        return None
    return np.asarray(value["data"], dtype=np.dtype(value["dtype"])).reshape(value["shape"])


class GenerationBuffer:
    """The per-rank generation buffer of §4 (host numpy; fields are per-row arrays).

    Typical use, one optimizer step = g micro-steps::

        for _ in range(config.gradient_accumulation_steps):
            if buffer.needs_generation:
                buffer.load(generate())          # B_gen rows in global order
            chunks = buffer.serve()              # [P] dicts of b rows: chunk k % S of each rank
    """

    def __init__(self, config: GRPOConfig, *, seed: int = 0):
        self.b = config.per_device_train_batch_size
        self.world_size = config.world_size
        self.steps_per_generation = config.generation.steps
        self.rule = MicroStepRule.of(config, 0)  # when a generation loads
        self.generation_batch_size = config.generation.size
        self.micro_step = 0  # k
        self._chunks: list[list[Batch]] | None = None  # [P][S]
        self._rng = np.random.default_rng(seed)

    @property
    def needs_generation(self) -> bool:
        """``k % (S·μ) == 0``, or nothing is buffered (a fresh start or a resume)."""
        return self._chunks is None or self.rule.loads_generation(self.micro_step)

    def load(self, batch: Batch) -> None:
        """Keep a generation batch (``B_gen`` rows, global order): slice, permute, split."""
        n = _rows(batch)
        if n != self.generation_batch_size:
            raise ValueError(f"a generation batch has {self.generation_batch_size} rows, got {n}")
        perm = self._rng.permutation(self.b * self.steps_per_generation)
        self._chunks = []
        for p in range(self.world_size):
            rows = rank_rows(
                p, per_device_batch=self.b, steps_per_generation=self.steps_per_generation
            )
            local = {
                k: v if v is None or np.ndim(v) == 0 else np.asarray(v)[rows][perm]
                for k, v in batch.items()
            }
            self._chunks.append(split_batch(local, self.steps_per_generation))

    def serve(self) -> list[Batch]:
        """Micro-step k: chunk ``k % S`` of every rank (``[P]`` dicts of b rows); k += 1."""
        if self._chunks is None:
            raise RuntimeError("the generation buffer is empty: load a generation batch first")
        i = self.micro_step % self.steps_per_generation
        self.micro_step += 1
        return [rank[i] for rank in self._chunks]

    def micro_steps(self, generate: Any, num_micro_steps: int) -> Iterator[list[Batch]]:
        """Serve ``num_micro_steps`` micro-steps, calling ``generate()`` whenever one is due."""
        for _ in range(num_micro_steps):
            if self.needs_generation:
                self.load(generate())
            yield self.serve()

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable: the counter, the permutation generator and the buffered chunks."""
        chunks = None
        if self._chunks is not None:
            chunks = [
                [{k: _encode(v) for k, v in chunk.items()} for chunk in rank]
                for rank in self._chunks
            ]
        return {
            "micro_step": self.micro_step,
            "rng": self._rng.bit_generator.state,
            "chunks": chunks,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.micro_step = int(state["micro_step"])
        self._rng.bit_generator.state = state["rng"]
        chunks = state["chunks"]
        self._chunks = (
            None
            if chunks is None
            else [[{k: _decode(v) for k, v in c.items()} for c in rank] for rank in chunks]
        )
