"""Seeded, deterministic, resumable prompt iterators, and the train / held-out eval split.

- `TaskPrompts`: an infinite stream over a generated task; example i comes from a numpy Generator
  seeded by (seed, split, i), so the whole state is {"seed", "index"}.
- `DatasetPrompts`: epochs over a dataset task, each a permutation seeded by (seed, epoch); the
  state is {"seed", "epoch", "position"}.
Both: `next(it)`, `next_batch(n)`, `state()` (a dict of plain ints), `restore(state)` and
`from_state(task, state, ...)`; a restored iterator yields exactly what the uninterrupted one would.

Split: a prompt is held out iff a stable hash of its text falls below `holdout` (the task's own,
default 1/16), so "train" and "eval" never share a prompt, whatever the seeds; a dataset task with a
separate eval file splits by file instead (`DatasetTask.split_indices`). "all" uses every prompt.
`check_splits` refuses a task whose train or eval split would be empty (`built.build` calls it).
"""

from __future__ import annotations

import abc
import hashlib
import math
import numbers
from collections.abc import Iterator

import numpy as np

from gspo_jax.tasks.base import DEFAULT_HOLDOUT, Example, Task
from gspo_jax.validation import check, check_choice

SPLITS = ("train", "eval", "all")
_MAX_DRAWS = 100_000  # per example, while looking for a prompt of the requested split


def in_holdout(prompt: str, holdout: float = DEFAULT_HOLDOUT) -> bool:
    """Whether `prompt` belongs to the held-out eval split (blake2b of the text, stable everywhere)."""
    digest = hashlib.blake2b(prompt.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < holdout


def _holdout(task: Task, holdout: float | None) -> float:
    """`holdout`, or the task's own (`VerifiableTask.holdout`) where None."""
    return getattr(task, "holdout", DEFAULT_HOLDOUT) if holdout is None else holdout


def _check_split(split: str, holdout: float) -> None:
    check_choice("prompt_iterator", "split", split, SPLITS)
    check(0.0 < holdout < 1.0, "prompt_iterator", "holdout", holdout, "a number in (0, 1)")


def check_splits(task: Task, holdout: float | None = None) -> None:
    """Raises ValueError (one line) if `task`'s train or eval split would be empty: a dataset task's
    splits are counted; a generated task's must both appear among prompts drawn with a fixed seed
    (enough draws that a split holding a `holdout` share of prompts is missed with odds below e^-40)."""
    holdout = _holdout(task, holdout)
    if _is_dataset(task):
        for split in ("train", "eval"):
            DatasetPrompts(task, split=split, holdout=holdout)  # raises naming the empty split
        return
    _check_split("train", holdout)
    rng = np.random.default_rng(0)
    draws = min(_MAX_DRAWS, max(1000, math.ceil(40 / min(holdout, 1 - holdout))))
    seen = set()
    for _ in range(draws):
        seen.add(in_holdout(task.sample(rng).prompt, holdout))
        if len(seen) == 2:
            return
    split = "eval" if False in seen else "train"  # the one never drawn
    raise ValueError(
        f"split {split!r} of {task.name!r} is empty: none of {draws} prompts drawn falls in it "
        f"(holdout={holdout}); change holdout or widen the task"
    )


def _is_dataset(task: Task) -> bool:
    return hasattr(task, "example") and hasattr(task, "__len__")


def _in_split(prompt: str, split: str, holdout: float) -> bool:
    return split == "all" or in_holdout(prompt, holdout) == (split == "eval")


def _check_state(state: dict, keys: tuple[str, ...]) -> dict[str, int]:
    if set(state) != set(keys):
        raise ValueError(f"state must have exactly the keys {keys}, got {sorted(state)}")
    for key in keys:
        value = state[key]
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise ValueError(f"state[{key!r}] must be a non-negative integer, got {value!r}")
    return {key: int(state[key]) for key in keys}


class _PromptIterator(Iterator[Example]):
    """What both iterators share: batching, and rebuilding one from its saved state."""

    def next_batch(self, n: int) -> list[Example]:
        """The next `n` examples."""
        return [next(self) for _ in range(n)]

    @abc.abstractmethod
    def state(self) -> dict[str, int]:
        """The position, as a dict of plain ints (checkpointed with the run)."""

    @abc.abstractmethod
    def restore(self, state: dict) -> None:
        """Moves to the position `state()` returned."""

    @classmethod
    def from_state(cls, task: Task, state: dict, **kwargs):
        """An iterator positioned where `state` (from `state()`) says."""
        it = cls(task, **kwargs)
        it.restore(state)
        return it


class TaskPrompts(_PromptIterator):
    """An infinite, seeded stream of examples from a generated task (see the module docstring)."""

    def __init__(self, task: Task, seed: int = 0, split: str = "train", holdout: float | None = None):
        holdout = _holdout(task, holdout)
        _check_split(split, holdout)
        self.task, self.split, self.holdout = task, split, holdout
        self.restore({"seed": seed, "index": 0})

    def example(self, index: int) -> Example:
        """The `index`-th example of this stream (random access; does not move the iterator)."""
        rng = np.random.default_rng([self.seed, SPLITS.index(self.split), index])
        for _ in range(_MAX_DRAWS):
            example = self.task.sample(rng)
            if _in_split(example.prompt, self.split, self.holdout):
                return example
        raise RuntimeError(f"no {self.split!r} prompt in {_MAX_DRAWS} draws; the task is too small to split")

    def __next__(self) -> Example:
        example = self.example(self.index)
        self.index += 1
        return example

    def state(self) -> dict[str, int]:
        return {"seed": self.seed, "index": self.index}

    def restore(self, state: dict) -> None:
        state = _check_state(state, ("seed", "index"))
        self.seed, self.index = state["seed"], state["index"]


class DatasetPrompts(_PromptIterator):
    """Epochs over a dataset task (`len(task)`, `task.example(i)`), reshuffled each epoch."""

    def __init__(self, task: Task, seed: int = 0, split: str = "train", holdout: float | None = None):
        holdout = _holdout(task, holdout)
        _check_split(split, holdout)
        if not _is_dataset(task):
            raise TypeError(f"{type(task).__name__} is not a dataset task (needs __len__ and example)")
        self.task, self.split, self.holdout = task, split, holdout
        if hasattr(task, "split_indices"):  # the task knows its split (e.g. a separate eval file)
            indices = task.split_indices(split, holdout)
        else:
            indices = [i for i in range(len(task)) if _in_split(task.example(i).prompt, split, holdout)]
        self.indices = np.array(indices, dtype=np.int64)
        if len(self.indices) == 0:
            raise ValueError(
                f"split {split!r} of {task.name!r} is empty: none of its {len(task)} records falls in it "
                f"(holdout={holdout}); change holdout, add records, or give a separate eval file"
            )
        self.restore({"seed": seed, "epoch": 0, "position": 0})

    def __len__(self) -> int:
        """The number of examples in one epoch of this split."""
        return len(self.indices)

    def _order(self) -> np.ndarray:
        if self._order_epoch != self.epoch:
            rng = np.random.default_rng([self.seed, self.epoch])
            self._order_cache, self._order_epoch = rng.permutation(self.indices), self.epoch
        return self._order_cache

    def __next__(self) -> Example:
        if self.position >= len(self.indices):
            self.epoch, self.position = self.epoch + 1, 0
        example = self.task.example(int(self._order()[self.position]))
        self.position += 1
        return example

    def state(self) -> dict[str, int]:
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position}

    def restore(self, state: dict) -> None:
        state = _check_state(state, ("seed", "epoch", "position"))
        if state["position"] > len(self.indices):
            raise ValueError(f"state['position'] must be <= {len(self.indices)}, got {state['position']}")
        self.seed, self.epoch, self.position = state["seed"], state["epoch"], state["position"]
        self._order_epoch = -1


def prompt_iterator(
    task: Task, seed: int = 0, split: str = "train", holdout: float | None = None
) -> TaskPrompts | DatasetPrompts:
    """`DatasetPrompts` for a dataset task, `TaskPrompts` for a generated one; `holdout` None: the
    task's own."""
    if _is_dataset(task):
        return DatasetPrompts(task, seed, split, holdout)
    return TaskPrompts(task, seed, split, holdout)
