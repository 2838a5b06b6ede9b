"""The common task interface: an `Example` and the `Task` protocol, plus the shared reward rule.

A task samples examples from a numpy Generator, reads an answer out of a completion, scores it, and
writes a correct completion (a demonstration) for a supervised warm start. Every task's fields are
its settings: `config.task.<name>` holds exactly them (`gspo_jax.config.task_config`).
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np

from gspo_jax.validation import check, check_number

DEFAULT_HOLDOUT = 1 / 16  # the share of prompts held out for evaluation (`prompts.in_holdout`)


@dataclasses.dataclass(frozen=True)
class Example:
    """One problem: the prompt shown to the model, the reference answer, and task-specific details."""

    prompt: str
    answer: str
    meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@runtime_checkable
class Task(Protocol):
    """What every task provides (built-in tasks are frozen dataclasses subclassing `VerifiableTask`)."""

    name: str

    def sample(self, rng: np.random.Generator) -> Example: ...

    def extract_answer(self, completion: str) -> str | None: ...

    def reward(self, completion: str, example: Example) -> float: ...

    def demonstration(self, example: Example) -> str: ...

    def max_prompt_tokens(self, encode: Callable[[str], list[int]]) -> int: ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class VerifiableTask(abc.ABC):
    """Shared reward rule: 1.0 if correct; `format_reward` if an answer was given in the right format
    (extract_answer is not None) but is wrong; 0.0 if no well-formed answer. Rewards lie in [0, 1].
    `holdout`: the share of prompts held out as the eval split (`prompts.in_holdout`)."""

    format_reward: float = 0.0
    holdout: float = DEFAULT_HOLDOUT

    def __post_init__(self) -> None:
        own = type(self).__name__
        fr = self.format_reward
        check_number(own, "format_reward", fr, low=0.0)
        check(fr < 1.0, own, "format_reward", fr, "a number in [0, 1)")
        object.__setattr__(self, "format_reward", float(fr))
        check_number(own, "holdout", self.holdout, low=0.0, strict=True)
        check(self.holdout < 1.0, own, "holdout", self.holdout, "a number in (0, 1)")
        object.__setattr__(self, "holdout", float(self.holdout))

    @abc.abstractmethod
    def sample(self, rng: np.random.Generator) -> Example:
        """Draws one example."""

    @abc.abstractmethod
    def extract_answer(self, completion: str) -> str | None:
        """The well-formed answer in `completion` (see `answers.py` for the format), or None."""

    @abc.abstractmethod
    def is_correct(self, answer: str, example: Example) -> bool:
        """Whether an extracted answer solves `example`."""

    @abc.abstractmethod
    def demonstration(self, example: Example) -> str:
        """A completion that earns reward 1 on `example`."""

    @abc.abstractmethod
    def max_prompt_tokens(self, encode: Callable[[str], list[int]]) -> int:
        """The most tokens any prompt of this task encodes to (checked against the prompt bucket)."""

    def reward(self, completion: str, example: Example) -> float:
        """Scores a completion (see the class docstring)."""
        answer = self.extract_answer(completion)
        if answer is None:
            return 0.0
        return 1.0 if self.is_correct(answer, example) else self.format_reward
