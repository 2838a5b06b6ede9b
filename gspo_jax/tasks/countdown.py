"""Countdown: reach a target from given numbers with + - * (and optionally /), each at most once.

Prompt "Make 33 from 3 7 12 with + - *.", completion "#### (12-7)*3+..." — the answer is an
expression. The verifier parses it with `expressions.parse` (never `eval`), rejects operators not
allowed, unary minus, unbalanced parentheses and division by zero, checks that it uses each given
number at most as often as it was given (exactly once each if `use_all`), and that it equals the
target exactly. Only solvable instances are generated: targets are drawn from the values a search
over the numbers can reach, and the shortest expression found is the demonstration.

Difficulty: `count` numbers in [1, `max_number`], targets in [`target_min`, `target_max`],
`allow_division`, `use_all`.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import ClassVar

import numpy as np

from gspo_jax.tasks import expressions
from gspo_jax.tasks.answers import answer_text, format_answer
from gspo_jax.tasks.base import Example, VerifiableTask
from gspo_jax.validation import check, check_int

_ATOM, _MUL, _ADD = 0, 1, 2  # precedence of an expression's top operator, for minimal parentheses
_MAX_ATTEMPTS = 1000


def _wrap(expr: str, prec: int, limit: int) -> str:
    return f"({expr})" if prec > limit else expr


def _combine(a: int, ea: str, pa: int, b: int, eb: str, pb: int, allow_division: bool):
    """Yields (value, expr, prec) for every positive-integer result of one operation on a and b."""
    yield a + b, f"{ea}+{eb}", _ADD
    yield a * b, f"{_wrap(ea, pa, _MUL)}*{_wrap(eb, pb, _MUL)}", _MUL
    if a > b:
        yield a - b, f"{ea}-{_wrap(eb, pb, _MUL)}", _ADD
    if b > a:
        yield b - a, f"{eb}-{_wrap(ea, pa, _MUL)}", _ADD
    if allow_division:
        if a % b == 0:
            yield a // b, f"{_wrap(ea, pa, _MUL)}/{_wrap(eb, pb, _ATOM)}", _MUL
        if b % a == 0:
            yield b // a, f"{_wrap(eb, pb, _MUL)}/{_wrap(ea, pa, _ATOM)}", _MUL


def _better(new: str, old: str | None) -> bool:
    return old is None or (len(new), new) < (len(old), old)


def solutions(numbers: tuple[int, ...], allow_division: bool = False, use_all: bool = False) -> dict[int, str]:
    """Every positive integer reachable from `numbers` (each used at most once, or exactly once if
    `use_all`), mapped to its shortest expression (ties broken alphabetically, so deterministic).

    Dynamic programming over subsets: the values of a subset combine the values of its two parts.
    Intermediate values stay positive integers, a subset of what the verifier accepts.
    """
    numbers = tuple(int(v) for v in numbers)
    if any(v < 1 for v in numbers):
        raise ValueError(f"numbers must be positive, got {numbers}")
    n = len(numbers)
    table: list[dict[int, tuple[str, int]]] = [{} for _ in range(1 << n)]
    for i, v in enumerate(numbers):
        table[1 << i] = {v: (str(v), _ATOM)}
    for mask in range(1, 1 << n):
        if mask & (mask - 1) == 0:
            continue
        best: dict[int, tuple[str, int]] = {}
        sub = (mask - 1) & mask
        while sub:
            rest = mask ^ sub
            if sub < rest:
                for a, (ea, pa) in table[sub].items():
                    for b, (eb, pb) in table[rest].items():
                        for value, expr, prec in _combine(a, ea, pa, b, eb, pb, allow_division):
                            if _better(expr, best.get(value, (None,))[0]):
                                best[value] = (expr, prec)
            sub = (sub - 1) & mask
        table[mask] = best
    masks = [(1 << n) - 1] if use_all else range(1, 1 << n)
    result: dict[int, str] = {}
    for mask in masks:
        for value, (expr, _) in table[mask].items():
            if _better(expr, result.get(value)):
                result[value] = expr
    return result


@dataclasses.dataclass(frozen=True, kw_only=True)
class CountdownTask(VerifiableTask):
    """Write an expression over the given numbers that equals the target (see the module docstring)."""

    name: ClassVar[str] = "countdown"
    count: int = 3
    max_number: int = 20
    target_min: int = 10
    target_max: int = 100
    allow_division: bool = False
    use_all: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        own = "CountdownTask"
        check_int(own, "count", self.count, 2, 5)
        check_int(own, "max_number", self.max_number, 2, 1000)
        check_int(own, "target_min", self.target_min, 1)
        check_int(own, "target_max", self.target_max, self.target_min, 10**6)
        for name in ("count", "max_number", "target_min", "target_max"):
            object.__setattr__(self, name, int(getattr(self, name)))
        for name in ("allow_division", "use_all"):
            check(isinstance(getattr(self, name), bool), own, name, getattr(self, name), "True or False")

    @property
    def ops(self) -> str:
        """The operators an answer may use."""
        return "+-*/" if self.allow_division else "+-*"

    def sample(self, rng: np.random.Generator) -> Example:
        for _ in range(_MAX_ATTEMPTS):
            numbers = tuple(int(v) for v in rng.integers(1, self.max_number + 1, size=self.count))
            found = solutions(numbers, self.allow_division, self.use_all)
            targets = sorted(v for v in found if self.target_min <= v <= self.target_max and v not in numbers)
            if targets:
                target = targets[int(rng.integers(len(targets)))]
                break
        else:
            raise RuntimeError(f"no solvable countdown instance in {_MAX_ATTEMPTS} draws; widen target_min..target_max")
        prompt = f"Make {target} from {' '.join(map(str, numbers))} with {' '.join(self.ops)}."
        if self.use_all:
            prompt += " Use all."
        return Example(
            prompt=prompt + "\n",
            answer=str(target),
            meta={"numbers": numbers, "target": target, "solution": found[target]},
        )

    def max_prompt_tokens(self, encode) -> int:
        """The widest target and numbers: the longest prompt in characters (and digits)."""
        numbers = " ".join([str(self.max_number)] * self.count)
        prompt = f"Make {self.target_max} from {numbers} with {' '.join(self.ops)}." + (
            " Use all." if self.use_all else ""
        )
        return len(encode(prompt + "\n"))

    def extract_answer(self, completion: str) -> str | None:
        """The answer line if it is a syntactically valid expression over the allowed operators."""
        text = answer_text(completion)
        if text is None:
            return None
        try:
            expressions.parse(text, self.ops)
        except expressions.ExpressionError:
            return None
        return text

    def is_correct(self, answer: str, example: Example) -> bool:
        try:
            tree = expressions.parse(answer, self.ops)
            value = expressions.evaluate(tree)
        except expressions.ExpressionError:
            return False
        used = collections.Counter(expressions.literals(tree))
        given = collections.Counter(int(v) for v in example.meta["numbers"])
        if self.use_all and used != given:
            return False
        if any(used[v] > given[v] for v in used):
            return False
        return value == int(example.meta["target"])

    def demonstration(self, example: Example) -> str:
        return format_answer(example.meta["solution"])
