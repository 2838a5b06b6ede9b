"""The completion format shared by all tasks, and how an answer is read out of a completion.

Format: a completion states its final answer on a line that starts with the marker, GSM8K style:

    ...optional working...
    #### 42

Rules (the same for every task):
- the LAST marker in the completion wins, even when several are on one line ("#### 1 #### 2" -> "2");
- the answer is the rest of that marker's line, stripped of surrounding whitespace; later lines
  without a marker are ignored;
- no marker, or nothing after the last one, means no answer (reward 0).
What counts as a valid answer on that line is the task's business: integer tasks accept only an
integer (see `parse_int`), so "#### 42 apples" or "#### 42." is a malformed answer there.
"""

from __future__ import annotations

import re

ANSWER_MARKER = "####"

_INT_RE = re.compile(r"\s*([+-]?)\s*([0-9]+)\s*")


def answer_text(completion: str) -> str | None:
    """The text after the last `####` marker, up to the end of its line, stripped; None if absent."""
    start = completion.rfind(ANSWER_MARKER)
    if start < 0:
        return None
    line = completion[start + len(ANSWER_MARKER) :].split("\n", 1)[0].strip()
    return line or None


def format_answer(value: object) -> str:
    """The canonical answer line for `value` (what demonstrations end with)."""
    return f"{ANSWER_MARKER} {value}"


def parse_int(text: str) -> int | None:
    """Reads an integer written with optional surrounding spaces, a +/- sign (spaces allowed after
    it) and leading zeros: " -  007 " -> -7. Anything else (decimals, commas, trailing text) -> None."""
    match = _INT_RE.fullmatch(text)
    if match is None:
        return None
    sign, digits = match.groups()
    digits = digits.lstrip("0") or "0"
    if len(digits) > 4000:  # Python refuses to parse longer decimal strings; nobody's answer is that long
        return None
    value = int(digits)
    return -value if sign == "-" else value
