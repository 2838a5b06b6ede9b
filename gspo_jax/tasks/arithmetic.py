"""Multi-digit integer arithmetic: "What is 123*456?" -> "#### 56088".

Difficulty: `digits` per operand (exactly that many, so 3 means 100..999; 1 means 0..9),
`operands` per problem, and the operator set `ops` (a subset of "+-*", usual precedence).
`working`, the share of demonstrations that show their working, one operation a line before the answer
("7+8=15\n15+9=24\n#### 24"; chosen per prompt by a hash, so a prompt's demonstration is fixed): the
warm-started policy then answers either way, long and accurate or short and less so, and under a budget
that cuts the long answers RL must trade the two (the DAPO ladder's regime, where truncation and what is
done about it matter).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import ClassVar

import numpy as np

from gspo_jax.tasks import expressions
from gspo_jax.tasks.answers import answer_text, format_answer, parse_int
from gspo_jax.tasks.base import Example, VerifiableTask
from gspo_jax.validation import check, check_int, check_number

ALLOWED_OPS = "+-*"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ArithmeticTask(VerifiableTask):
    """Evaluate an integer expression; the answer is an integer (leading zeros, sign spaces allowed)."""

    name: ClassVar[str] = "arithmetic"
    digits: int = 3
    operands: int = 2
    ops: str = ALLOWED_OPS
    working: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("ArithmeticTask", "digits", self.digits, 1, 18)
        check_int("ArithmeticTask", "operands", self.operands, 2, 8)
        object.__setattr__(self, "digits", int(self.digits))
        object.__setattr__(self, "operands", int(self.operands))
        ops = self.ops
        ok = isinstance(ops, str) and ops and all(op in ALLOWED_OPS for op in ops) and len(set(ops)) == len(ops)
        check(ok, "ArithmeticTask", "ops", ops, f"a non-empty string of distinct operators from {ALLOWED_OPS!r}")
        check_number("ArithmeticTask", "working", self.working, low=0.0, high=1.0)

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
        steps = working_lines(example) if shows_working(example.prompt, self.working) else []
        return "".join(line + "\n" for line in steps) + format_answer(example.answer)


def shows_working(prompt: str, share: float) -> bool:
    """Whether `prompt`'s demonstration shows its working: a hash of the prompt (blake2b, personalised
    apart from the eval split's) below `share`."""
    digest = hashlib.blake2b(prompt.encode("utf-8"), digest_size=8, person=b"working").digest()
    return int.from_bytes(digest, "big") / 2**64 < share


def working_lines(example: Example) -> list[str]:
    """The steps of `example`'s evaluation, one operation a line ("7*8=56"): products first, left to
    right, then sums and differences left to right (the usual precedence)."""
    values, ops = list(example.meta["operands"]), list(example.meta["ops"])
    lines = []
    while ops:
        i = ops.index("*") if "*" in ops else 0
        a, op, b = values[i], ops[i], values[i + 1]
        value = a * b if op == "*" else a + b if op == "+" else a - b
        lines.append(f"{a}{op}{b}={value}")
        values[i : i + 2], ops[i : i + 1] = [value], []
    return lines
