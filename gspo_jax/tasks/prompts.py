"""Seeded, deterministic, resumable prompt iterators, and the train / held-out eval split.

- `TaskPrompts`: an infinite stream over a generated task; example i comes from a numpy Generator
  seeded by (seed, split, i), so the whole state is {"seed", "index"}.
- `DatasetPrompts`: epochs over a dataset task, each a permutation seeded by (seed, epoch); the
  state is {"seed", "epoch", "position"}.
Both: `next(it)`, `next_batch(n)`, `state()` (a dict of plain ints), `restore(state)` and
`from_state(task, state, ...)`; a restored iterator yields exactly what the uninterrupted one would.

Split: a prompt is held out iff a stable hash of its text falls below `holdout` (default 1/16), so
"train" and "eval" never share a prompt, whatever the seeds. "all" uses every prompt.
"""

from __future__ import annotations

import abc
import hashlib
import numbers
from collections.abc import Iterator

import numpy as np

from gspo_jax.tasks.base import Example, Task
from gspo_jax.validation import check, check_choice

SPLITS = ("train", "eval", "all")
DEFAULT_HOLDOUT = 1 / 16
_MAX_DRAWS = 100_000  # per example, while looking for a prompt of the requested split


def in_holdout(prompt: str, holdout: float = DEFAULT_HOLDOUT) -> bool:
    """Whether `prompt` belongs to the held-out eval split (blake2b of the text, stable everywhere)."""
    digest = hashlib.blake2b(prompt.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < holdout


def _check_split(split: str, holdout: float) -> None:
    check_choice("prompt_iterator", "split", split, SPLITS)
    check(0.0 < holdout < 1.0, "prompt_iterator", "holdout", holdout, "a number in (0, 1)")


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

    def __init__(self, task: Task, seed: int = 0, split: str = "train", holdout: float = DEFAULT_HOLDOUT):
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

    def __init__(self, task: Task, seed: int = 0, split: str = "train", holdout: float = DEFAULT_HOLDOUT):
        _check_split(split, holdout)
        if not (hasattr(task, "example") and hasattr(task, "__len__")):
            raise TypeError(f"{type(task).__name__} is not a dataset task (needs __len__ and example)")
        self.task, self.split, self.holdout = task, split, holdout
        self.indices = np.array(
            [i for i in range(len(task)) if _in_split(task.example(i).prompt, split, holdout)], dtype=np.int64
        )
        if len(self.indices) == 0:
            raise ValueError(f"split {split!r} of {task.name!r} is empty (holdout={holdout})")
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
    task: Task, seed: int = 0, split: str = "train", holdout: float = DEFAULT_HOLDOUT
) -> TaskPrompts | DatasetPrompts:
    """`DatasetPrompts` for a dataset task, `TaskPrompts` for a generated one."""
    if hasattr(task, "example") and hasattr(task, "__len__"):
        return DatasetPrompts(task, seed, split, holdout)
    return TaskPrompts(task, seed, split, holdout)
