"""Document feeds: seeded epochs of a dataset, a give-back queue, and docs_per_step planning.

The epoch order (:func:`epoch_permutation`) is the one every trainer uses: SFT and DPO documents
here, GRPO prompts in ``jaxrl.rollout.buffer``. The feed is host state; its ``state_dict`` goes
into every checkpoint (the data cursor), so a resumed run sees exactly the documents an
uninterrupted run would have seen.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np


def epoch_permutation(num_items: int, *, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The order of epoch ``epoch``: a permutation seeded by ``(seed, epoch)``, or the identity
    without shuffling (int64 ``[num_items]``)."""
    if not shuffle:
        return np.arange(num_items)
    return np.random.default_rng([seed, epoch]).permutation(num_items)


class OutOfDataError(RuntimeError):
    """The data ran out before a step could be filled; no partial step is taken."""


class DocumentFeed:
    """Document ids in seeded epoch permutations, with returned ids served first."""

    def __init__(
        self, num_docs: int, *, seed: int, shuffle: bool = True, num_epochs: int | None = None
    ):
        if num_docs < 1:
            raise ValueError("a document feed needs at least one document")
        self.num_docs, self.seed, self.shuffle, self.num_epochs = (
            num_docs,
            seed,
            shuffle,
            num_epochs,
        )
        self.epoch, self.position = 0, 0
        self._returned: deque[int] = deque()
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return epoch_permutation(self.num_docs, seed=self.seed, epoch=epoch, shuffle=self.shuffle)

    def available(self) -> int | None:
        """Documents left (``None`` when epochs are unlimited)."""
        if self.num_epochs is None:
            return None
        left_in_epoch = self.num_docs - self.position
        later = (self.num_epochs - self.epoch - 1) * self.num_docs
        return len(self._returned) + max(left_in_epoch + later, 0)

    def take(self, n: int) -> list[int]:
        """Up to ``n`` ids: returned ones first, then the epoch order (fewer only at the end)."""
        out: list[int] = []
        while len(out) < n and self._returned:
            out.append(self._returned.popleft())
        while len(out) < n:
            if self.position == self.num_docs:
                if self.num_epochs is not None and self.epoch + 1 >= self.num_epochs:
                    break
                self.epoch += 1
                self.position = 0
                self._order = self._permutation(self.epoch)
            k = min(n - len(out), self.num_docs - self.position)
            out.extend(int(i) for i in self._order[self.position : self.position + k])
            self.position += k
        return out

    def take_exactly(self, n: int, *, step: int, unit: str) -> list[int]:
        """:meth:`take` of a step that needs all ``n`` ids (``unit``: what they are, for the
        message); ``OutOfDataError`` naming ``step`` when fewer are left."""
        ids = self.take(n)
        if len(ids) < n:
            raise OutOfDataError(
                f"step {step}: the data ran out with {len(ids)} {unit} available for a step of {n}"
            )
        return ids

    @property
    def epochs(self) -> float:
        """Passes over the data so far, as a float (``epoch`` in metrics rows): 1.5 = one full
        pass and half of the next; ids given back do not count until they are taken again."""
        taken = self.epoch * self.num_docs + self.position - len(self._returned)
        return taken / self.num_docs

    def give_back(self, ids: list[int]) -> None:
        """Return unconsumed ids to the front, keeping their order."""
        self._returned.extendleft(reversed(ids))

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "returned": list(self._returned)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._returned = deque(int(i) for i in state["returned"])
        self._order = self._permutation(self.epoch)


def cut_rounds(micro_batches: list[list[list[int]]], target: int) -> int:
    """Rounds to consume so the global document count reaches ``target`` (Fast-LLM's rule).

    Round m is micro-batch m of every rank; its count is summed over ranks; the round that
    crosses the target is kept. Returns the number of rounds (all of them if never reached).
    """
    total = 0
    rounds = len(micro_batches[0])
    for m in range(rounds):
        total += sum(len(rank[m]) for rank in micro_batches)
        if total >= target:
            return m + 1
    return rounds
