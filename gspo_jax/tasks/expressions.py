"""A small, safe parser and exact evaluator for integer arithmetic expressions (no `eval`).

Grammar (usual precedence, left-associative, no unary operators, spaces ignored):
    expr   := term (("+" | "-") term)*
    term   := factor (("*" | "/") factor)*
    factor := INTEGER | "(" expr ")"
Only the operators passed in `ops` are accepted. Values are exact `Fraction`s, so "/" is exact
division. Length, nesting and literal size are bounded so hostile input cannot exhaust time or stack.
"""

from __future__ import annotations

import dataclasses
import re
from fractions import Fraction

ALL_OPS = "+-*/"
MAX_LENGTH = 256  # characters
MAX_DEPTH = 32  # nested parentheses
MAX_LITERAL_DIGITS = 30

_TOKEN_RE = re.compile(r"\s*(?:([0-9]+)|(\S))")


class ExpressionError(ValueError):
    """The text is not a valid expression, or it cannot be evaluated (e.g. division by zero)."""


@dataclasses.dataclass(frozen=True)
class Num:
    """An integer literal."""

    value: int


@dataclasses.dataclass(frozen=True)
class BinOp:
    """A binary operation `left op right`."""

    op: str
    left: Num | BinOp
    right: Num | BinOp


Node = Num | BinOp


def _tokenize(text: str, ops: str) -> list[str | int]:
    tokens: list[str | int] = []
    pos = 0
    text = text.rstrip()
    while pos < len(text):
        match = _TOKEN_RE.match(text, pos)
        number, symbol = match.groups()
        if number is not None:
            if len(number.lstrip("0")) > MAX_LITERAL_DIGITS:
                raise ExpressionError(f"number too long: {number[:12]}...")
            tokens.append(int(number))
        elif symbol in ops or symbol in "()":
            tokens.append(symbol)
        else:
            raise ExpressionError(f"unexpected character {symbol!r}")
        pos = match.end()
    return tokens


class _Parser:
    """Recursive descent over a token list."""

    def __init__(self, tokens: list[str | int]):
        self.tokens, self.pos, self.depth = tokens, 0, 0

    def peek(self) -> str | int | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def expr(self) -> Node:
        node = self.term()
        while self.peek() in ("+", "-"):
            op = self.tokens[self.pos]
            self.pos += 1
            node = BinOp(op, node, self.term())
        return node

    def term(self) -> Node:
        node = self.factor()
        while self.peek() in ("*", "/"):
            op = self.tokens[self.pos]
            self.pos += 1
            node = BinOp(op, node, self.factor())
        return node

    def factor(self) -> Node:
        token = self.peek()
        if isinstance(token, int):
            self.pos += 1
            return Num(token)
        if token == "(":
            self.depth += 1
            if self.depth > MAX_DEPTH:
                raise ExpressionError("parentheses nested too deeply")
            self.pos += 1
            node = self.expr()
            if self.peek() != ")":
                raise ExpressionError("unbalanced parentheses: missing ')'")
            self.pos += 1
            self.depth -= 1
            return node
        if token is None:
            raise ExpressionError("expression ends where a number was expected")
        raise ExpressionError(f"expected a number or '(', got {token!r}")


def parse(text: str, ops: str = ALL_OPS) -> Node:
    """Parses `text` into a tree, accepting only the operators in `ops`; raises ExpressionError."""
    if len(text) > MAX_LENGTH:
        raise ExpressionError(f"expression longer than {MAX_LENGTH} characters")
    parser = _Parser(_tokenize(text, ops))
    node = parser.expr()
    if parser.peek() is not None:
        token = parser.peek()
        reason = "unbalanced parentheses: extra ')'" if token == ")" else f"unexpected {token!r}"
        raise ExpressionError(reason)
    return node


def evaluate(node: Node) -> Fraction:
    """The exact value of a tree; raises ExpressionError on division by zero."""
    if isinstance(node, Num):
        return Fraction(node.value)
    left, right = evaluate(node.left), evaluate(node.right)
    if node.op == "+":
        return left + right
    if node.op == "-":
        return left - right
    if node.op == "*":
        return left * right
    if right == 0:
        raise ExpressionError("division by zero")
    return left / right


def literals(node: Node) -> list[int]:
    """The integer literals of a tree, left to right."""
    if isinstance(node, Num):
        return [node.value]
    return literals(node.left) + literals(node.right)
