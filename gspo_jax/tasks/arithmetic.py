"""Multi-digit integer arithmetic: "What is 123*456?" -> "#### 56088".

Difficulty: `digits` per operand (exactly that many, so 3 means 100..999; 1 means 0..9),
`operands` per problem, and the operator set `ops` (a subset of "+-*", usual precedence).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

from gspo_jax.tasks import expressions
from gspo_jax.tasks.answers import answer_text, format_answer, parse_int
from gspo_jax.tasks.base import Example, VerifiableTask
from gspo_jax.validation import check, check_int

ALLOWED_OPS = "+-*"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ArithmeticTask(VerifiableTask):
    """Evaluate an integer expression; the answer is an integer (leading zeros, sign spaces allowed)."""

    name: ClassVar[str] = "arithmetic"
    digits: int = 3
    operands: int = 2
    ops: str = ALLOWED_OPS

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("ArithmeticTask", "digits", self.digits, 1, 18)
        check_int("ArithmeticTask", "operands", self.operands, 2, 8)
        object.__setattr__(self, "digits", int(self.digits))
        object.__setattr__(self, "operands", int(self.operands))
        ops = self.ops
        ok = isinstance(ops, str) and ops and all(op in ALLOWED_OPS for op in ops) and len(set(ops)) == len(ops)
        check(ok, "ArithmeticTask", "ops", ops, f"a non-empty string of distinct operators from {ALLOWED_OPS!r}")

    def sample(self, rng: np.random.Generator) -> Example:
        low = 0 if self.digits == 1 else 10 ** (self.digits - 1)
        values = [int(v) for v in rng.integers(low, 10**self.digits, size=self.operands)]
        ops = [self.ops[int(i)] for i in rng.integers(0, len(self.ops), size=self.operands - 1)]
        text = str(values[0]) + "".join(op + str(v) for op, v in zip(ops, values[1:], strict=True))
        value = expressions.evaluate(expressions.parse(text, ALLOWED_OPS))
        return Example(
            prompt=f"What is {text}?\n",
            answer=str(int(value)),
            meta={"operands": tuple(values), "ops": tuple(ops)},
        )

    def max_prompt_tokens(self, encode) -> int:
        """Every operand at full width: the longest prompt in characters (and digits)."""
        widest = "9" * self.digits
        return len(encode(f"What is {widest}{(self.ops[0] + widest) * (self.operands - 1)}?\n"))

    def extract_answer(self, completion: str) -> str | None:
        """The answer as a canonical integer string ("007" -> "7", "+ 5" -> "5"), or None."""
        text = answer_text(completion)
        value = None if text is None else parse_int(text)
        return None if value is None else str(value)

    def is_correct(self, answer: str, example: Example) -> bool:
        value = parse_int(answer)
        return value is not None and value == int(example.answer)

    def demonstration(self, example: Example) -> str:
        return format_answer(example.answer)
